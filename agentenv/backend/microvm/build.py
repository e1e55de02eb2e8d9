"""`python -m agentenv.backend.microvm.build`: make what the microvm backend would otherwise make on its first
use, at install time (scripts/install_microvm.sh calls it): the initramfs and the root file system image of
the base sandbox image (`agentenv images build base` first). Both are cached by content, so a second run
on a ready host only checks. Exits 1 with the reason when the host lacks a piece."""

from __future__ import annotations

import argparse
import sys

from agentenv.backend import images
from agentenv.backend.microvm import hostfiles, initrd, rootfs
from agentenv.backend.settings import BackendSettings
from agentenv.errors import AgentEnvError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default="base", help="the sandbox image to convert (default: base)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    settings = BackendSettings.load()
    try:
        files = hostfiles.find(settings.microvm_kernel_dir)
        made = [initrd.build(files, settings.microvm_dir),
                rootfs.build(images.build(args.image, quiet=True).tag, settings.microvm_dir, files.mkfs_ext4)]
    except AgentEnvError as e:
        print(f"microvm: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        for path in made:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
