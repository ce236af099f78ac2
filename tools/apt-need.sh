#!/usr/bin/env bash
# usage: tools/apt-need.sh COMMAND PACKAGE WHY   (COMMAND may be a file path, e.g. a library)
# Installs Debian's PACKAGE when COMMAND is missing (CI runs as root on Debian); anywhere else it stops with
# one line saying what to install, since make cannot sudo on the reader's behalf.
set -euo pipefail
command="$1" package="$2" why="$3"
have() { command -v "$command" >/dev/null 2>&1 || { [[ "$command" == /* ]] && [ -e "$command" ]; }; }
have && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$command is missing ($why): install it, e.g. sudo apt-get install -y $package" >&2
  exit 1
fi
echo "$command is missing ($why): apt-get install -y $package"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$package" >>"$log" 2>&1; }
# a fresh container has no package lists yet: update once, only when the first attempt fails
if ! install && ! { apt-get update -q >>"$log" 2>&1 && install; }; then
  tail -n 5 "$log" >&2
  echo "apt-get install -y $package failed (last lines above): $command is needed $why" >&2
  exit 1
fi
have || { echo "$package is installed but $command is still missing" >&2; exit 1; }
