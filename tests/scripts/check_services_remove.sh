#!/usr/bin/env bash
# scripts/services replaces a Debian 13 root that is broken (no .idemq-root,
# or a server program missing) by building it again. Such a root can still
# hold the state dir of running servers, bind-mounted into it at its own
# path (root_mount). Replacing the root must unmount that first: removing
# the tree through the mount deletes the state dir itself.
#
# Runs scripts/services' own root_build_at (the file sourced as a library)
# on a broken root with a state dir bind-mounted in it; debootstrap is a
# stand-in that makes a root with the one program asked for.
set -euo pipefail
src=$1
if [[ $(id -u) != 0 ]]; then
    echo "check_services_remove: needs root (mount --bind); skipped"
    exit 77
fi
tmp=$(mktemp -d /tmp/idemq-remove-XXXXXX)
cache=$tmp/cache root=$tmp/cache/trixie-test state=$tmp/state
cleanup() {
    awk -v d="$tmp/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r |
        while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
mkdir -p "$state/pg/data" "$root$state" "$tmp/bin"
echo "a running server's data" >"$state/pg/data/PG_VERSION"
mount --bind "$state" "$root$state"
# broken: no .idemq-root and no server program
cat >"$tmp/bin/debootstrap" <<'STUB'
#!/bin/sh
mkdir -p "$4/usr/bin" && printf '#!/bin/sh\n' >"$4/usr/bin/server" && chmod +x "$4/usr/bin/server"
STUB
chmod +x "$tmp/bin/debootstrap"

# shellcheck disable=SC1091
IDEMQ_SERVICES_LIBRARY=1 IDEMQ_ROOT_CACHE=$cache IDEMQ_STATE_DIR=$state source "$src/scripts/services"
PATH=$tmp/bin:$PATH
(root_build_at "$root" "test spec" "none" "$tmp/build.log" .lock-test "nothing" usr/bin/server) \
    >"$tmp/out" 2>&1 || true
cat "$tmp/out"
fail=0
if [[ ! -f $state/pg/data/PG_VERSION ]]; then
    echo "FAIL: replacing the broken root deleted the state dir mounted in it"
    fail=1
fi
if ! [[ -x $root/usr/bin/server && -f $root/.idemq-root ]]; then
    echo "FAIL: the broken root was not replaced by the new build"
    fail=1
fi
if awk -v d="$root/" 'index($2, d) == 1 { f = 1 } END { exit !f }' /proc/self/mounts; then
    echo "FAIL: a mount is left inside the replaced root"
    fail=1
fi
((fail == 0)) && echo "check_services_remove: ok"
exit "$fail"
