#!/usr/bin/env bash
# Stages, on this machine, what dev/gpu_speed.sh needs on a GPU machine that has no network: the device call
# carries ignored folders of the checkout, at most 64 MiB a call, and a fresh checkout has none of them.
#   REF_GIT=<the reference's git directory> bash dev/gpu_stage.sh
# REF_GIT: a snapshot of github:SamsungSAILMontreal/TinyRecursiveModels (a bare clone or a mirror's git directory);
# REF_BENCH: the script that times the reference's step (default ../shared/gpu/ref_gpu_bench.py); PYTAG: the GPU
# machine's Python as a wheel tag (default 312). It writes:
#   .gpu/ref/models, .gpu/ref_gpu_bench.py  the reference's model code at its snapshot's HEAD, and its timer
#   .gpu/whl                                pydantic and its dependencies (the reference's configs need it)
#   .gpu/quack                              quack-kernels and the CuTe DSL's Python parts (kernels='quack')
#   .gpu_libs/cu13.tar.xz                   the CuTe DSL's CUDA 13 compiler library, unpacked from its wheel and
#                                           packed: 193 MB unpacked, too big to travel beside .gpu
# then the two calls that use them (docs/speed.md, "the prepared GPU run"). QUACK=0 leaves quack out.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${REF_GIT:-}" ] || { echo "gpu_stage: REF_GIT=<the git directory of the reference> is needed" >&2; exit 1; }
REF_BENCH=${REF_BENCH:-../shared/gpu/ref_gpu_bench.py}
PYTAG=${PYTAG:-312}
QUACK=${QUACK:-1}
QUACK_PINS="quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
            nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"
CU13_PIN=nvidia-cutlass-dsl-libs-cu13==4.8.1
[ -f "$REF_BENCH" ] || { echo "gpu_stage: no $REF_BENCH (REF_BENCH=...)" >&2; exit 1; }
git --git-dir="$REF_GIT" rev-parse --verify -q HEAD:models >/dev/null 2>&1 \
    || { echo "gpu_stage: $REF_GIT is not a git directory whose HEAD holds models/" >&2; exit 1; }

# wheels for the GPU machine's Python and platform, not this machine's
download() {  # folder, pip arguments...
    local dir=$1; shift
    python -m pip download --quiet --only-binary=:all: --python-version "$PYTAG" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$@" 2> >(grep -v '^WARNING: Location' >&2)
}

rm -rf .gpu .gpu_libs
mkdir -p .gpu/ref .gpu_libs
git --git-dir="$REF_GIT" archive HEAD models | tar -x -C .gpu/ref
cp "$REF_BENCH" .gpu/ref_gpu_bench.py
echo "reference: models/ of $(git --git-dir="$REF_GIT" rev-parse --short HEAD)"
download .gpu/whl pydantic
if [ "$QUACK" = 1 ]; then
    # --no-deps: torch, einops and cuda-bindings are the GPU machine's own; the CUDA 13 library travels apart
    # shellcheck disable=SC2086
    download .gpu/quack --no-deps $QUACK_PINS
    tmp=$(mktemp -d)
    download "$tmp" --no-deps "$CU13_PIN"
    mkdir "$tmp/site"
    python -m zipfile -e "$tmp"/*.whl "$tmp/site"
    XZ_OPT=-9 tar -cJf .gpu_libs/cu13.tar.xz -C "$tmp/site" .
    rm -rf "$tmp"
fi
for d in .gpu .gpu_libs; do
    kib=$(du -sk "$d" | cut -f1)
    echo "$d: $((kib / 1024)) MiB$( ((kib > 64 * 1024)) && echo ': over the 64 MiB a device call carries')"
done
echo "next, on one warm GPU machine: a call carrying .gpu_libs that runs"
echo "  mkdir -p .gpu_site/site-packages && tar -xJf .gpu_libs/cu13.tar.xz -C .gpu_site/site-packages"
echo "then one carrying .gpu that runs"
echo "  OUT=\$OUT AB=quack bash dev/gpu_speed.sh"
