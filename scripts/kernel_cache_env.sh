# Sourced by the device scripts: a carried kernel cache (scripts/kernel_cache_pack.py) unpacked once
# into CUPYMOE_CACHE_DIR, so the device loads the cubins it holds instead of compiling them.
if [ -f .kcache.tar.xz ] && [ -z "${CUPYMOE_CACHE_DIR:-}" ]; then
  export CUPYMOE_CACHE_DIR=$(python3 scripts/kernel_cache_pack.py --unpack .kcache.tar.xz)
fi
