#!/usr/bin/env bash
# Prepare an aarch64 cross build (NEON/SVE) on an x86-64 Debian host, without an Arm machine:
#   1. host tools: cross compiler, qemu user-mode emulator, cmake, ninja (apt-get, needs root);
#   2. arm64 builds of the libraries, unpacked into a private root directory that
#      cmake/toolchains/aarch64-linux-gnu.cmake points CMake at.
# Step 2 runs apt-get with a private configuration: the system's apt setup and dpkg database
# are never modified and no foreign dpkg architecture is added.
#
# Usage: scripts/setup-aarch64.sh [ROOT]     (default ROOT: <repo>/.deps/aarch64-root)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="${1:-$REPO/.deps/aarch64-root}"
HOST_PKGS=(g++-aarch64-linux-gnu qemu-user cmake ninja-build)
# librapidcheck-dev, libgtest-dev and libgmock-dev ship static libraries only; libhwy-dev and
# libbenchmark-dev link against the shared libraries of libhwy1 and libbenchmark1debian.
# libc6/libstdc++6/libgcc-s1 come with the cross toolchain (/usr/aarch64-linux-gnu).
ARM_PKGS=(libhwy-dev libhwy1 libgtest-dev libgmock-dev librapidcheck-dev libxsimd-dev
          libbenchmark-dev libbenchmark1debian)
STAMP="$ROOT/.setup-aarch64.stamp"

say() { echo "setup-aarch64: $*"; }
die() { echo "setup-aarch64: error: $*" >&2; exit 1; }

# --- 1. host tools ------------------------------------------------------------------------
missing=()
for p in "${HOST_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  # Only this step needs root; the private download below runs as the caller, so the root
  # directory stays owned by whoever builds with it.
  SUDO=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "not root and no sudo: as root, apt-get install ${missing[*]}"
    SUDO=(sudo)
  fi
  say "installing host packages: ${missing[*]}"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  say "host packages present"
fi

# --- 2. arm64 libraries into the private root ----------------------------------------------
# Fast path: the stamp records the package list that was extracted last time.
want="${ARM_PKGS[*]}"
if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
  say "arm64 libraries already in $ROOT (delete $STAMP to refetch)"
  exit 0
fi
# Refuse to wipe a directory this script did not create.
if [[ -d $ROOT && ! -f $STAMP && -n "$(ls -A "$ROOT")" ]]; then
  die "$ROOT exists, is not empty and has no stamp: remove it or pass another directory"
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"/{state/lists/partial,cache/archives/partial,debs,root}
: >"$WORK/state/status"   # empty dpkg status: apt sees nothing installed for arm64

# Private source list, derived from the machine's own sources so that the same mirrors (and
# their keyrings) are used. Read as apt reads them: /etc/apt/sources.list and every *.list
# (one-line format) and *.sources (deb822) file of /etc/apt/sources.list.d, whatever their
# names (Debian images say debian.sources, mmdebstrap 0000debian.sources).
SRC="$WORK/sources.list"
: >"$SRC"
shopt -s nullglob
deb822=(/etc/apt/sources.list.d/*.sources)
oneline=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list)
shopt -u nullglob
if ((${#deb822[@]})); then
  # deb822: stanzas separated by blank lines; a field may list several values (two suites on
  # one line); continuation lines start with a blank. A file ends a stanza too.
  awk '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && tolower(enabled) != "no") {
        opt = "arch=arm64"; if (signed ~ /^\//) opt = opt " signed-by=" signed
        nu = split(uris, U, " "); ns = split(suites, S, " ")
        for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++)
          print "deb [" opt "] " U[i] " " S[j] " " comps
      }
      types = uris = suites = comps = signed = enabled = ""; key = ""
    }
    FNR == 1 { flush() }
    /^#/ { next }
    /^[ \t]*$/ { flush(); next }
    /^[ \t]/ { next }                      # continuation (e.g. an inline key): ignored
    {
      key = tolower(substr($0, 1, index($0, ":") - 1)); val = substr($0, index($0, ":") + 1)
      gsub(/^[ \t]+|[ \t]+$/, "", val)
      if (key == "types") types = val; else if (key == "uris") uris = val
      else if (key == "suites") suites = val; else if (key == "components") comps = val
      else if (key == "signed-by") signed = val; else if (key == "enabled") enabled = val
    }
    END { flush() }' "${deb822[@]}" >>"$SRC"
fi
for f in "${oneline[@]}"; do
  [[ -f $f ]] || continue
  # One-line format: keep "deb" lines, drop any arch= option, add arch=arm64.
  sed -nE '/^[[:space:]]*deb[[:space:]]/{
      s/arch=[^][:space:]]*//
      s/^[[:space:]]*deb[[:space:]]+\[/deb [arch=arm64 /; t p
      s/^[[:space:]]*deb[[:space:]]+/deb [arch=arm64] /
      :p
      p }' "$f" >>"$SRC"
done
[[ -s $SRC ]] || die "no Debian sources found in /etc/apt/sources.list or /etc/apt/sources.list.d/*.{list,sources}"

# Private apt configuration. The machine's apt.conf.d is NOT read (Dir::Etc::Parts): it holds
# hooks such as APT::Update::Post-Invoke-Success (appstream, packagekit) that would act on the
# system. Its Acquire::* settings (proxy, mirror validity, compression) are copied instead,
# because the private download needs to reach the mirror the same way the system does.
{
  apt-config dump Acquire | grep -v '^Acquire::IndexTargets' || true
  cat <<EOF
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
APT::Sandbox::User "$(id -un)";
Dir::State "$WORK/state";
Dir::State::Lists "$WORK/state/lists";
Dir::State::status "$WORK/state/status";
Dir::Cache "$WORK/cache";
Dir::Etc::SourceList "$SRC";
Dir::Etc::SourceParts "/dev/null";
Dir::Etc::Preferences "/dev/null";
Dir::Etc::PreferencesParts "/dev/null";
Dir::Etc::Parts "/dev/null";
EOF
} >"$WORK/apt.conf"
export APT_CONFIG="$WORK/apt.conf"

say "fetching arm64 package lists ($(wc -l <"$SRC") sources)"
apt-get update -q >"$WORK/update.log" 2>&1 || { cat "$WORK/update.log" >&2; die "apt-get update (arm64, private) failed"; }
grep -E '^(W|E):' "$WORK/update.log" >&2 || true

say "downloading: $want"
(cd "$WORK/debs" && apt-get download -q "${ARM_PKGS[@]}" >"$WORK/download.log" 2>&1) \
  || { cat "$WORK/download.log" >&2; die "apt-get download failed"; }

for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/root"; done
# Absolute symlinks would resolve on the host (to x86-64 files or nothing): make them
# relative, pointing inside the root wherever the root ends up.
while IFS= read -r -d '' l; do
  ln -sfnr "$WORK/root$(readlink "$l")" "$l"
done < <(find "$WORK/root" -type l -lname '/*' -print0)
[[ -f "$WORK/root/usr/include/hwy/highway.h" ]] || die "extraction incomplete: hwy/highway.h missing"

# Replace the root only now, so an interrupted run never leaves a half-filled root behind
# a valid stamp.
rm -rf "$ROOT"
mkdir -p "$(dirname "$ROOT")"
mv "$WORK/root" "$ROOT"
echo "$want" >"$STAMP"
say "extracted $(ls "$WORK"/debs/*.deb | wc -l) packages into $ROOT"
