# Sourced first by a device call's script, from the project root: `set -u` and the call's clock.
# `total` is TOTAL_S seconds (default 585, inside the device tool's 600 s a call); `left` says how
# many are still left.
set -u
start=$(date +%s)
total=${TOTAL_S:-585}
left() { echo $(( total - ($(date +%s) - start) )); }
