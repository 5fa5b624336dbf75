#!/usr/bin/env bash
# The core checks on another torch: `make compat TORCH=2.4.1` (or tools/compat.sh 2.4.1).
# Never in CI: a torch build is a multi-GB download. It makes (or reuses) a throwaway venv
# $COMPAT_DIR/torch-$VERSION with that torch, pytest and hypothesis, puts this checkout's src/ on
# PYTHONPATH (muonkit itself is not installed, so its torch pin cannot pull another torch), and runs:
#   1. one device: the optimizer against its float64 reference, the optimizer contract, checkpoints,
#      and tests/contract/test_compat.py (FSDP2 params: the step, or on a torch older than the DTensor
#      floor, the named error "DTensor parameters (...) need torch >= Y");
#   2. examples/plain_loop.py; examples/ddp.py under torchrun at 2 gloo ranks (DDP, then a DCP
#      checkpoint saved and loaded: below muonkit._compat.CHECKPOINT_TORCH the training runs and the
#      checkpoint raises the named error);
#   3. from muonkit._compat.DTENSOR_TORCH on, examples/fsdp2.py and examples/mesh_2d.py at 2 ranks
#      (the 2-D mesh: the named error where DeviceMesh cannot name a sub-mesh's root).
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
    echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), python $("$VENV/bin/python" -V 2>&1), $(date -u +%F), commit $(git -C "$ROOT" describe --always --dirty 2>/dev/null)"
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
at_least() {  # at_least NAME: whether this torch reaches muonkit._compat.NAME
    "$VENV/bin/python" -c "import sys; from muonkit._compat import $1, torch_at_least; sys.exit(not torch_at_least($1))"
}
expect_named_error() {  # NAME LOG TEXT...: the log holds each TEXT (a named TorchVersionError, the work before it)
    local name=$1 log=$2; shift 2
    for text in "$@"; do
        grep -qF "$text" "$log" || { echo "$name: missing from the log: $text" | tee -a "$RESULTS"; status=1; return; }
    done
    echo "$name: raised the named error as expected: $(grep -m1 -o 'TorchVersionError: .*' "$log")" | tee -a "$RESULTS"
}
TORCHRUN=("$VENV/bin/python" -m torch.distributed.run --standalone --nproc_per_node=2)
run one-device "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/tests/numerics/test_hybrid_muon.py" \
    "$ROOT/tests/contract/test_contract.py" "$ROOT/tests/checkpoints/test_checkpoint.py" "$ROOT/tests/contract/test_compat.py"
run plain-loop "$VENV/bin/python" "$ROOT/examples/plain_loop.py"
if at_least CHECKPOINT_TORCH; then
    run ddp-2-ranks "${TORCHRUN[@]}" "$ROOT/examples/ddp.py" "$DIR/ddp-checkpoint"
else  # DDP trains; its DCP checkpoint raises the named error
    (cd "$DIR" && "${TORCHRUN[@]}" "$ROOT/examples/ddp.py" "$DIR/ddp-checkpoint") > "$DIR/ddp-2-ranks.log" 2>&1
    expect_named_error ddp-2-ranks "$DIR/ddp-2-ranks.log" "matrices orthogonalized by rank 0" \
        "TorchVersionError: muonkit.distributed.checkpoint (save_checkpoint, load_checkpoint) needs torch >="
fi
if at_least DTENSOR_TORCH; then  # below the floor, test_compat.py above checked the named error
    run fsdp2-2-ranks "${TORCHRUN[@]}" "$ROOT/examples/fsdp2.py"
    if "$VENV/bin/python" -c "from torch.distributed.device_mesh import DeviceMesh as M; M._get_root_mesh" 2>/dev/null; then
        run mesh-2d-2-ranks "${TORCHRUN[@]}" "$ROOT/examples/mesh_2d.py"
    else  # sub-meshes of one root: the named error (muonkit._compat.SUBMESH_TORCH)
        (cd "$DIR" && "${TORCHRUN[@]}" "$ROOT/examples/mesh_2d.py") > "$DIR/mesh-2d-2-ranks.log" 2>&1
        expect_named_error mesh-2d-2-ranks "$DIR/mesh-2d-2-ranks.log" "TorchVersionError: HybridMuon on DTensors of several sub-meshes"
    fi
fi
echo "results: $RESULTS"
exit $status
