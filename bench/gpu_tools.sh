#!/usr/bin/env bash
# iproute2 (ip, tc) for the shaped lab on a GPU machine that has none, as a folder that travels
# with the checkout: Debian's packages, downloaded here (apt-get download, as root or not) and
# unpacked into gpu_tools/root, with gpu_tools/bin/{ip,tc} running them on their own libraries.
# bench/gpu_check.sh puts gpu_tools/bin on its PATH where `ip` is missing. Nothing is installed,
# here or there. The wrappers give the loader the libraries' folders for `ip` and `tc` alone
# (ld.so --library-path, not LD_LIBRARY_PATH), so that what `ip netns exec` starts (the lab's
# ranks) loads the machine's own. x86-64 (amd64) machines: the packages' and the loader's.
#   bash bench/gpu_tools.sh [DIR]    # DIR: gpu_tools
set -eu
dir=$(realpath -m "${1:-gpu_tools}")
# iproute2 and the libraries it needs beyond glibc, zlib and SELinux's (on every image)
packages="iproute2 libbpf1 libelf1 libmnl0 libxtables12 libtirpc3 libtirpc-common libdb5.3 libbsd0 libmd0 libcap2"
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/root" "$dir/bin"
(cd "$dir/debs" && apt-get download $packages)
for deb in "$dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
libs=$(find "$dir/root" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
for tool in ip tc; do
    bin=$(find "$dir/root" -path "*bin/$tool" -type f | head -1)
    # the path relative to the wrapper: the folder may travel to another path
    cat > "$dir/bin/$tool" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/..
exec /lib64/ld-linux-x86-64.so.2 --library-path "$(echo "$libs" | sed "s#$dir#\$here#g")" "\$here${bin#$dir}" "\$@"
WRAP
    chmod +x "$dir/bin/$tool"
done
rm -rf "$dir/debs"
"$dir/bin/ip" -V
du -sh "$dir"
