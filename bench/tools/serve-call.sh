# Sourced first by the serving scripts of one device call (serve_device_run.sh, serve_users_run.sh),
# from the project root: the call's clock (TOTAL_S seconds, default 585; `left` says the seconds
# still left), the serving environment (serve-env.sh; exit 3 where it cannot be made) and the GPU.
set -u
start=$(date +%s)
total=${TOTAL_S:-585}
left() { echo $(( total - ($(date +%s) - start) )); }
source bench/tools/serve-env.sh || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
