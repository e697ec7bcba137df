#!/usr/bin/env bash
# Debian's chromium for the Attention tab's browser test (tests/test_explorer_browser.py), when missing. Never a
# browser download: Playwright drives /usr/bin/chromium. Without root or sudo (or off Debian) the test is skipped,
# except under CI, where this fails instead.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  SUDO="none"
fi
if [ "$SUDO" != none ] && command -v apt-get >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  exit 0
fi
if [ "${CI:-}" = true ]; then
  echo "chromium is missing and cannot be installed (no root, sudo or apt-get): the browser test needs it" >&2
  exit 1
fi
echo "note: no /usr/bin/chromium and no way to install it here; the browser test will be skipped" >&2
