#!/usr/bin/env bash
# apt_install PACKAGE...: install Debian packages (as root, or with sudo), quietly; sourced by the set-up scripts.
apt_install() {
  (($#)) || return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  printf '[%s] installing Debian packages: %s\n' "$(basename "$0" .sh)" "$*"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}
