"""The `microvm` backend: every sandbox is a QEMU microVM (bookworm's QEMU 7.2, `-M microvm`) booted from
Debian's cloud kernel with a small initramfs, its root file system a read-only disk made from the sandbox's
Docker image, and a guest agent on virtio-serial ports that runs its commands (`guest/agent.py`).

Guest RAM lives in a file: a pause stops the VM, saves its device state (tens of KiB) and leaves its memory
in the file, synced and dropped from the page cache (no process, no memory); a resume maps the file back in
a new QEMU; forks map one snapshot copy-on-write. docs/agentenv.md, "The microvm backend", tells the story;
`runtime.MicroVMRuntime` is the `SandboxBackend`.

This file imports nothing: `agentenv.backend.selection` imports the runtime only when it is configured.
"""
