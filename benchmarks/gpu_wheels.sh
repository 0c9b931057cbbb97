#!/usr/bin/env bash
# Wheels of digen_jax's runtime packages that a GPU machine's Python may lack (its image holding
# jax with CUDA, flax, optax, orbax, torch and transformers, but not the rest): downloaded here
# for CPython 3.12 on x86-64 Linux, each named (no dependency resolution), into DIR.
#
#   bash benchmarks/gpu_wheels.sh [DIR]          # default .whl (add it to .git/info/exclude)
#
# then, on the GPU machine, before `python benchmarks/gpu_check.py` or any run:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# promise (a tensorflow-datasets dependency) is published as a source archive only: it is built
# into a pure-Python wheel here. The list is what an H200 image with jax 0.11.2 / flax 0.12.10 /
# torch 2.11 lacked on 2026-11-28 (README "Running on GPUs"); a machine missing more needs more.
set -euo pipefail
dir="${1:-.whl}"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" \
  diffusers==0.42.1 ml-collections==1.1.0 tensorflow-datasets==4.9.10 array-record==0.8.6 \
  tensorboardX==2.6.5 dm-tree immutabledict simple-parsing docstring-parser \
  tensorflow-metadata googleapis-common-protos termcolor toml importlib-metadata
python3 -m pip wheel -q --no-deps promise==2.3 -w "$dir"
ls "$dir"
