"""The `microvm` backend: every sandbox is a QEMU microVM (bookworm's QEMU 7.2, `-M microvm`) booted from
Debian's cloud kernel with a small initramfs, its root file system a read-only disk made from the sandbox's
Docker image, and a guest agent on virtio-serial ports that runs its commands (`guest/agent.py`).

Guest RAM lives in a file, so a pause leaves no process and no memory behind. This file imports nothing:
`agentenv.backend.selection` imports the runtime only when it is configured.

Design: docs/design/sandboxes.md#agentenv-backend-microvm.
"""
