#!/usr/bin/env bash
# apt_need.sh PATH PACKAGE: installs Debian's PACKAGE unless PATH (a file it ships) exists.
# Used for what the venv cannot hold: the xxhash header the native module compiles against,
# and the redis-server the tests start.
set -euo pipefail
path=$1 package=$2
if [ -e "$path" ]; then
  exit 0
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
echo "installing Debian's $package (for $path)" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$package" >/dev/null
[ -e "$path" ] || { echo "apt installed $package but $path is still missing" >&2; exit 1; }
