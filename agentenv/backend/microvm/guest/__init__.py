"""Files that run inside a sandbox microVM, not on the host: the initramfs's `init.sh` and the guest agent
`agent.py` (standard library only; the host copies it into the initramfs and never imports it)."""
