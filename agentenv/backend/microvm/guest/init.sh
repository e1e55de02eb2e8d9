#!/bin/busybox sh
# The init of a sandbox microVM's initramfs (busybox-static): loads the virtio modules listed in
# /modules.order, mounts the sandbox image's read-only disk (/dev/vda) under an overlay whose writes stay in
# guest memory, mounts /run, /dev/shm and /dev/pts, and hands over to the guest agent (agent.py) as PID 1 of
# a new PID namespace; this shell's successor, util-linux's `unshare`, stays the guest's PID 1. Any failure
# prints AGENTENV-BOOT-FAILED and powers the guest off. With `agentenv.probe` on the kernel command line it
# only says AGENTENV-PROBE-OK and powers off (the host's test of an accelerator).
/bin/busybox mkdir -p /bin /proc /sys /dev /lower /rw /newroot
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
  echo "AGENTENV-BOOT-FAILED: $*" >/dev/console
  poweroff -f
}

mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
for m in $(cat /modules.order); do
  insmod "/modules/$m.ko" || fail "insmod $m"
done
if grep -qw agentenv.probe /proc/cmdline; then
  echo AGENTENV-PROBE-OK >/dev/console
  poweroff -f
fi

i=0
while [ ! -b /dev/vda ]; do
  i=$((i + 1))
  [ $i -gt 1000 ] && fail "no /dev/vda (the sandbox image's disk) after 10 s"
  sleep 0.01
done
mount -t ext4 -o ro /dev/vda /lower || fail "mount the sandbox image /dev/vda"
mount -t tmpfs -o mode=755 rw /rw || fail "mount the overlay's tmpfs"
mkdir /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "mount the overlay"
[ -x /newroot/usr/bin/python3 ] || fail "the sandbox image has no /usr/bin/python3 (the guest agent runs on it)"
[ -x /newroot/usr/bin/unshare ] || fail "the sandbox image has no /usr/bin/unshare (util-linux)"
mount -t tmpfs -o mode=755,nosuid,nodev run /newroot/run || fail "mount /run"
mkdir -p /newroot/run/agentenv-guest
chmod 700 /newroot/run/agentenv-guest
cp /agent.py /newroot/run/agentenv-guest/agent.py
for d in dev proc sys; do
  mount --move "/$d" "/newroot/$d" || fail "move /$d"
done
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev,size=64m shm /newroot/dev/shm || fail "mount /dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,nosuid,noexec devpts /newroot/dev/pts || fail "mount /dev/pts"
ln -sf pts/ptmx /newroot/dev/ptmx
exec switch_root /newroot /usr/bin/unshare --pid --fork --mount-proc -- \
  /usr/bin/python3 -I -S /run/agentenv-guest/agent.py
