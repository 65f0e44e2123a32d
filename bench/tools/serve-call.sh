# Sourced first by the serving scripts of one device call (serve_device_run.sh, serve_users_run.sh),
# from the project root: the call's clock (TOTAL_S seconds, default 585; `left` says the seconds
# still left), the serving environment (serve-env.sh; exit 3 where it cannot be made) and the GPU.
source bench/tools/call-clock.sh
source bench/tools/serve-env.sh || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
