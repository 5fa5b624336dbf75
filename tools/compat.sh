#!/usr/bin/env bash
# The core checks on another torch: `make compat TORCH=2.4.1` (or tools/compat.sh 2.4.1).
# Never in CI: a torch build is a multi-GB download. It makes (or reuses) a throwaway venv
# $COMPAT_DIR/torch-$VERSION with that torch, pytest and hypothesis, puts this checkout's src/ on
# PYTHONPATH (muonkit itself is not installed, so its torch pin cannot pull another torch), and runs:
#   1. one device: the optimizer against its float64 reference, the optimizer contract, checkpoints,
#      and tests/contract/test_compat.py (FSDP2 params: the step, or on a torch older than the DTensor
#      floor, the named error "DTensor parameters (...) need torch >= Y");
#   2. DDP: examples/plain_loop.py on one process and examples/ddp.py under torchrun at 2 gloo ranks.
# It writes $COMPAT_DIR/torch-$VERSION/results.txt (each check's exit status and summary line).
# torch comes from PyPI unless TORCH_INDEX names another index (the CPU wheels at
# https://download.pytorch.org/whl/cpu are far smaller where that host is reachable).
set -uo pipefail
VERSION=${1:?usage: tools/compat.sh TORCH_VERSION}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${COMPAT_DIR:-$ROOT/runs/compat}/torch-$VERSION
VENV=$DIR/venv
PY=${PY:-python3}
mkdir -p "$DIR"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || exit 1
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
    "$VENV/bin/pip" install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==$VERSION" || exit 1
    "$VENV/bin/pip" install -q "numpy<2" pytest==8.3.4 hypothesis==6.122.3 || exit 1
fi
RESULTS=$DIR/results.txt
{
    echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), python $("$VENV/bin/python" -V 2>&1), $(date -u +%F), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
} > "$RESULTS"
export PYTHONPATH=$ROOT/src OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1
status=0
run() {  # run NAME COMMAND...: record the exit status and the last line
    local name=$1; shift
    (cd "$DIR" && "$@") > "$DIR/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc: $(grep -v '^\s*$' "$DIR/$name.log" | tail -1)" | tee -a "$RESULTS"
    [ $rc -eq 0 ] || status=1
}
run one-device "$VENV/bin/python" -m pytest -q -p no:cacheprovider -x "$ROOT/tests/numerics/test_hybrid_muon.py" \
    "$ROOT/tests/contract/test_contract.py" "$ROOT/tests/checkpoints/test_checkpoint.py" "$ROOT/tests/contract/test_compat.py"
run plain-loop "$VENV/bin/python" "$ROOT/examples/plain_loop.py"
run ddp-2-ranks "$VENV/bin/python" -m torch.distributed.run --standalone --nproc_per_node=2 "$ROOT/examples/ddp.py" "$DIR/ddp-checkpoint"
echo "results: $RESULTS"
exit $status
