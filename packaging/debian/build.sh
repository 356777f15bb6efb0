#!/bin/sh
# Build the edgekit-agent .deb:  packaging/debian/build.sh OUTDIR   (prints the .deb's path)
#
# The package carries its own Python environment in /opt/edgekit, made here at package-build time
# (not at postinst time from bundled wheels): `uv venv --relocatable` on the system python3, then
# the agent's dependencies at exactly the versions in requirements/lock.txt. So the device needs no
# network and no pip at install time, dpkg owns (and --purge removes) every file, and a build on
# another architecture (arm64 for a Jetson or Coral board) is the same command run there. The cost:
# one .deb per architecture and Python minor version, which Depends: on that python3.X.
#
# Environment: PYTHON (the interpreter the venv uses, default /usr/bin/python3), UV (default: on
# PATH, else the one next to this repo's .venv python), DEB_GZIP_LEVEL (default 6; CI passes 1),
# DEB_ARCH (default: this machine's; amd64 or arm64 cross-builds from the other one: uv installs that
# architecture's wheels; the device needs the same python3.X as PYTHON here).
set -eu

out=${1:?usage: packaging/debian/build.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-/usr/bin/python3}
UV=${UV:-$(command -v uv || echo "$root/.venv/bin/uv")}
level=${DEB_GZIP_LEVEL:-6}
umask 022

for tool in dpkg-deb "$UV" "$PYTHON"; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool not found; install it first" >&2; exit 1; }
done

version=$("$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
    "$root/pyproject.toml")
pyname=$("$PYTHON" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')
arch=${DEB_ARCH:-$(dpkg --print-architecture)}
platform=""
if [ "$arch" != "$(dpkg --print-architecture)" ]; then
    case "$arch" in
        arm64) platform=aarch64-manylinux_2_28 ;;
        amd64) platform=x86_64-manylinux_2_28 ;;
        *) echo "build.sh: cannot cross-build for $arch (amd64 or arm64); build on such a machine" >&2; exit 1 ;;
    esac
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
pkg="$stage/edgekit-agent"

# -- the private environment: the agent extra, pinned by the lock ------------------------------
"$UV" venv --quiet --relocatable --python "$PYTHON" "$pkg/opt/edgekit"
# a copy of the source tree (no build/ or egg-info left in the checkout; a clean build every time)
mkdir "$stage/src"
(cd "$root" && tar -cf - pyproject.toml README.md LICENSE edgekit device_agents) | tar -xf - -C "$stage/src"
"$UV" pip install --quiet --link-mode=copy --python "$pkg/opt/edgekit/bin/python" ${platform:+--python-platform "$platform"} \
    --constraint "$root/requirements/lock.txt" "$stage/src[agent]"
# The interpreter by its minor version (python3 may point elsewhere on the device); no console scripts
# (uv's relocatable ones are sh/Python polyglots): /usr/bin/edgekit-agent and /usr/bin/edgekit run the
# modules. No byte-code (postinst compiles it), no uv bookkeeping, shared objects not executable, modules
# not scripts.
venv="$pkg/opt/edgekit"
ln -sfn "$(dirname "$PYTHON")/$pyname" "$venv/bin/python"
find "$venv/bin" -mindepth 1 ! -name python ! -name python3 ! -name "$pyname" -exec rm -f {} +
rm -f "$venv/.lock" "$venv/.gitignore" "$venv/CACHEDIR.TAG"
find "$venv" -type d -name __pycache__ -prune -exec rm -rf {} +
find "$venv/lib" -type f \( -name '*.so' -o -name '*.so.*' -o -name '*.py' -o -path '*.dist-info/*' \) -exec chmod 0644 {} +

# -- files ---------------------------------------------------------------------------------------
install -D -m 0644 "$root/packaging/systemd/edgekit-agent.service" "$pkg/lib/systemd/system/edgekit-agent.service"
install -D -m 0644 "$root/packaging/agent.example.toml" "$pkg/etc/edgekit/agent.toml"
install -d -m 0755 "$pkg/etc/edgekit/keys"
install -d -m 0755 "$pkg/usr/bin"
for command in edgekit-agent:device_agents.cli edgekit:edgekit.cli; do
    printf '#!/bin/sh\n# %s from the private environment of the edgekit-agent package\nexec /opt/edgekit/bin/python -I -m %s "$@"\n' \
        "${command%%:*}" "${command#*:}" > "$pkg/usr/bin/${command%%:*}"
    chmod 0755 "$pkg/usr/bin/${command%%:*}"
done
doc="$pkg/usr/share/doc/edgekit-agent"
install -D -m 0644 "$here/README.md" "$doc/README.md"
install -D -m 0644 "$here/copyright" "$doc/copyright"
sed "s/@VERSION@/$version/" "$here/changelog" | gzip -9n > "$doc/changelog.gz"
chmod 0644 "$doc/changelog.gz"
install -D -m 0644 "$here/lintian-overrides" "$pkg/usr/share/lintian/overrides/edgekit-agent"

# -- control -------------------------------------------------------------------------------------
install -d -m 0755 "$pkg/DEBIAN"
size=$(du -sk --apparent-size "$pkg" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@INSTALLED_SIZE@/$size/" -e "s/@PYTHON@/$pyname/" \
    "$here/control.in" > "$pkg/DEBIAN/control"
echo /etc/edgekit/agent.toml > "$pkg/DEBIAN/conffiles"
for script in postinst prerm postrm; do
    install -m 0755 "$here/$script" "$pkg/DEBIAN/$script"
done
(cd "$pkg" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) \
    > "$pkg/DEBIAN/md5sums"
chmod 0644 "$pkg/DEBIAN/control" "$pkg/DEBIAN/conffiles" "$pkg/DEBIAN/md5sums"

mkdir -p "$out"
deb="$out/edgekit-agent_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zgzip "-z$level" --build "$pkg" "$deb" >/dev/null
echo "$deb"
