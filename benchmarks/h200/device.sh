#!/usr/bin/env bash
# On the lent H200, from the repository root (the device tool's `run`): one step of a measuring session.
# Every step writes what it measured under $OUT (at most 8 files of 16 MiB come back) and prints a summary.
#   install BATCH...          carried wheel batches (.gpu/A ...; benchmarks/h200/batches.sh) into /tmp/site
#   setup                     the plugin and its tools (sglang-ddtree, sglang-ddtree-tools) of this checkout into
#                             /tmp/site; SGLang, the plugin and the tools import
#   cpuspeed                  each CPU's time for one pinned Python loop, $REPS passes -> $OUT/cpuspeed.txt
#   glue                      python -m ddtree_checks.glue_check (no SGLang server)     -> $OUT/glue_check.txt
#   kit                       train the tiny pairs (trainkit, seed $SEED, default 0, ~200 s) into /tmp/tiny
#                                                         -> $OUT/kit-*.tgz
#                             SEEDS="0 5": those seeds side by side into /tmp/tiny-sSEED, /tmp/tiny linked to the
#                                                         first -> $OUT/kit-sSEED-FAMILY.tgz, trainkit-sSEED.log
#   usekit SEED               the following steps serve that seed's kit (/tmp/tiny -> /tmp/tiny-sSEED)
#   unkit                     a carried kit (.gpu/kit/kit-*.tgz, prompts.jsonl, manifest.json) into /tmp/tiny
#   bench FAMILY MODES BUDGETS CONC [GLUE]   (BUDGETS: bench --budgets, schedules among them: "31;1:127,4:31")
#                             python -m sglang_ddtree_tools.bench, each server alone, graphs on, --profile-steps 20,
#                             SGLANG_DDTREE_GLUE_GRAPHS=GLUE (default: unset, the plugin's own default: 2 on a
#                             dense target, 1 on a hybrid one), --rounds $ROUNDS (default 1),
#                             --graphs $GRAPHS (default on; off or both for the graphs on/off figures),
#                             SGLANG_DDTREE_OVERLAP=$OVERLAP where set (1: DDTREE on SGLang's overlap scheduler;
#                             both / on / off: bench --overlap, each DDTREE server its own - both: one of each a round),
#                             --cpus $CPUS where set (every server pinned there, the clients on the other CPUs),
#                             --spy (py-spy around every server, instead of the profile) where SPY=1,
#                             --server-args "$SERVER_ARGS" (every server) where set, --requests $REQUESTS (default 16),
#                             --profile-concurrency $PROFILE_CONC where set (the profile's requests in flight)
#                                                         -> $OUT/bench-FAMILY-gGLUE[-GRAPHS][-ovOVERLAP][-TAG].{json,txt,png}
#                             and the logs (with SPY=1 the py-spy captures; with RAW_TRACES=1 the DDTREE servers'
#                             profiler traces) -> $OUT/bench-...-raw.tgz (only the logs where that passes 16 MB)
#   propose BENCH_JSON        report.propose_schedule on a bench report -> stdout: the schedule (stderr: why)
#   replay FAMILY BUDGETS     python -m sglang_ddtree_tools.replay on the kit's prompts (128 tokens, cuda): the
#                             accept length a server with this pair should report, to hold bench's against
#                             -> $OUT/replay-FAMILY.{json,txt}
#   matrix FAMILY BUDGETS     python -m ddtree_checks.serve_matrix (item 6, $MATRIX_PROMPTS (64) x 128, conc 1 and 8;
#                             MATRIX_OVERLAP=both serves each tree-verify budget on both schedulers; FAMILY-gN, e.g.
#                             hybrid-g2: that family with SGLANG_DDTREE_GLUE_GRAPHS=N, beside the others)
#                             -> $OUT/matrix-FAMILY.{json,txt}
# The plugin's own switches set on a call (SGLANG_DDTREE_CHAIN_STEP=plugin|dflash, SGLANG_DDTREE_STATS_EVERY, ...)
# reach every server it starts; bench's report keeps them (settings.ddtree_env).
# The call sequence and what each takes: benchmarks/h200/README.md.
set -u
SITE=${SITE:-/tmp/site}  # the install target (kept while the machine stays warm)
export PYTHONPATH=$SITE:$PWD/overlays/sglang-ddtree/gpu_checks SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$SITE"
step=${1:?step: install, setup, cpuspeed, glue, kit, usekit, unkit, bench, propose, replay or matrix}; shift
# never `pkill -f sglang.launch_server`: the pattern is in this shell's own command line when a caller passes it
stop_servers() { pkill -f "[s]glang.launch_server" 2>/dev/null; sleep 2; pkill -9 -f "[s]glang.launch_server" 2>/dev/null; true; }
case "$step" in
  install)
    set -o pipefail
    for b in "$@"; do
      [ -d "$b" ] || { echo "no batch $b here: name it in the call's carry" >&2; exit 2; }
      for t in "$b"/*.tgz; do [ -e "$t" ] || continue; tar xzf "$t" -C "$SITE" || exit 1; done
      if ls "$b"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
          "$b"/*.whl 2>&1 | { grep -v WARNING || true; } | tail -3 || { echo "pip install of $b failed" >&2; exit 1; }
      fi
    done
    echo "installed $* ($(ls "$SITE" | wc -l) entries in $SITE)";;
  setup)
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" \
      ./overlays/sglang-ddtree ./overlays/sglang-ddtree-tools 2>&1 | grep -v WARNING | tail -3
    rm -rf overlays/sglang-ddtree/build overlays/sglang-ddtree-tools/build
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
    # where the host's noise may come from: the CPUs the GPU is local to, the CPU model, what else runs
    nvidia-smi topo -m 2>/dev/null | head -4; lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|NUMA|Thread)'
    python3 -c "import torch, triton, sglang, sgl_kernel, sglang_ddtree, sglang_ddtree_tools, transformers; \
print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__, \
'transformers', transformers.__version__, 'plugin', sglang_ddtree.__file__, 'tools', sglang_ddtree_tools.__file__)";;
  cpuspeed)
    # each CPU's speed for one Python loop, REPS times over (a vCPU whose hyperthread sibling is busy in another
    # guest runs a host-bound process slower without any steal showing): ms per CPU, one line a pass
    for rep in $(seq "${REPS:-3}"); do
      line="cpuspeed pass $rep ms:"
      for c in $(seq 0 $(($(nproc) - 1))); do
        line="$line $c=$(taskset -c "$c" python3 -c 'import time
t = time.perf_counter(); s = 0
for i in range(3000000): s += i
print(round((time.perf_counter() - t) * 1000, 1))')"
      done
      echo "$line" | tee -a "$OUT/cpuspeed.txt"
    done;;
  glue)
    set -o pipefail
    timeout 300 python3 -m ddtree_checks.glue_check 2>&1 | tee "$OUT/glue_check.txt";;
  kit)
    # SEEDS="0 5": one kit a seed, trained side by side into /tmp/tiny-sSEED (the GPU is far from busy with
    # one), /tmp/tiny linked to the first; each family's kit -> $OUT/kit-sSEED-FAMILY.tgz with its prompts and
    # manifest inside. Without SEEDS: seed $SEED into /tmp/tiny, as kit-FAMILY.tgz, prompts.jsonl, manifest.json.
    set -o pipefail
    if [ -n "${SEEDS:-}" ]; then
      rm -rf /tmp/tiny; pids=()
      for s in $SEEDS; do
        rm -rf "/tmp/tiny-s$s"
        timeout 540 python3 -m sglang_ddtree_tools.trainkit "/tmp/tiny-s$s" --seed "$s" --device cuda \
          --drafter-chain-target 4.0 > "$OUT/trainkit-s$s.log" 2>&1 &
        pids+=($!)
      done
      rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
      for s in $SEEDS; do
        tail -12 "$OUT/trainkit-s$s.log"
        for f in hybrid dense; do
          tar czf "$OUT/kit-s$s-$f.tgz" -C /tmp "tiny-s$s/$f-target" "tiny-s$s/$f-drafter" \
            "tiny-s$s/prompts.jsonl" "tiny-s$s/manifest.json" || rc=1
        done
      done
      set -- $SEEDS; ln -sfn "/tmp/tiny-s$1" /tmp/tiny
      ls -la "$OUT"; exit $rc
    fi
    rm -rf /tmp/tiny
    timeout 500 python3 -m sglang_ddtree_tools.trainkit /tmp/tiny --seed "${SEED:-0}" --device cuda --drafter-chain-target 4.0 \
      2>&1 | tee "$OUT/trainkit.log" | tail -25 || exit 1
    for f in hybrid dense; do tar czf "$OUT/kit-$f.tgz" -C /tmp tiny/$f-target tiny/$f-drafter; done
    cp /tmp/tiny/prompts.jsonl "$OUT/" 2>/dev/null; cp /tmp/tiny/manifest.json "$OUT/" 2>/dev/null
    ls -la "$OUT";;
  usekit)
    # usekit SEED: the steps after it serve the kit of that seed (/tmp/tiny -> /tmp/tiny-sSEED)
    s=${1:?SEED}
    [ -d "/tmp/tiny-s$s" ] || { echo "no kit of seed $s here (kit with SEEDS, or unkit its kit-s$s-*.tgz)" >&2; exit 2; }
    if [ -d /tmp/tiny ] && [ ! -L /tmp/tiny ]; then
      rmdir /tmp/tiny 2>/dev/null || { echo "/tmp/tiny holds another kit: not replaced" >&2; exit 2; }
    fi
    ln -sfn "/tmp/tiny-s$s" /tmp/tiny; ls -la /tmp/tiny/;;
  unkit)
    # kit-FAMILY.tgz (+ prompts.jsonl, manifest.json) into /tmp/tiny; kit-sSEED-FAMILY.tgz into /tmp/tiny-sSEED
    [ ! -L /tmp/tiny ] || rm -f /tmp/tiny
    mkdir -p /tmp/tiny
    for t in .gpu/kit/kit-*.tgz; do tar xzf "$t" -C /tmp || exit 1; done
    cp .gpu/kit/prompts.jsonl .gpu/kit/manifest.json /tmp/tiny/ 2>/dev/null
    ls /tmp/tiny/ /tmp/tiny-s* 2>/dev/null;;
  bench)
    fam=${1:?FAMILY} modes=${2:?MODES} budgets=${3:?BUDGETS} conc=${4:?CONC} glue=${5:-def}
    name=bench-$fam-g$glue${GRAPHS:+-$GRAPHS}${OVERLAP:+-ov$OVERLAP}${TAG:+-$TAG}
    o=/tmp/$name
    rm -rf "$o"
    set -o pipefail
    unset SGLANG_DDTREE_GLUE_GRAPHS SGLANG_DDTREE_OVERLAP
    [ "$glue" = def ] || export SGLANG_DDTREE_GLUE_GRAPHS=$glue
    ovarg=()
    case "${OVERLAP:-}" in
      "") ;;
      both|on|off) ovarg=(--overlap "$OVERLAP");;  # per DDTREE server, in the same rounds (bench --overlap)
      *) export SGLANG_DDTREE_OVERLAP=$OVERLAP;;  # the whole call (1 / 0)
    esac
    timeout "${BENCH_TIMEOUT:-570}" python3 -m sglang_ddtree_tools.bench --tiny /tmp/tiny \
      --family "$fam" --launcher process --out "$o" --modes "$modes" --budgets "$budgets" --graphs "${GRAPHS:-on}" \
      ${ovarg[@]+"${ovarg[@]}"} --concurrency "$conc" --max-new-tokens 128 --requests "${REQUESTS:-16}" --profile-steps 20 --rounds "${ROUNDS:-1}" \
      ${CPUS:+--cpus "$CPUS"} ${SPY:+--spy "$SITE/bin/py-spy"} ${SERVER_ARGS:+--server-args "$SERVER_ARGS"} \
      ${PROFILE_CONC:+--profile-concurrency "$PROFILE_CONC"} 2>&1 | tee "$OUT/$name.log"
    rc=$?
    stop_servers
    for x in json txt png; do cp "$o/bench.$x" "$OUT/$name.$x" 2>/dev/null; done
    # the raw traces of the DDTREE servers (the ones whose host time is being cut), within what comes back
    # the step profiles' summaries are in the JSON; the raw traces are big (and only 8 files come back a call)
    (cd "$o" && tar czf "$OUT/$name-raw.tgz" logs $(ls -d spy 2>/dev/null) \
      $([ -n "${RAW_TRACES:-}" ] && ls -d profiles/*tree-verify* 2>/dev/null))
    [ "$(stat -c %s "$OUT/$name-raw.tgz")" -lt 16000000 ] || \
      (cd "$o" && tar czf "$OUT/$name-raw.tgz" logs)
    exit $rc;;
  propose)
    # propose BENCH_JSON: report.propose_schedule on a bench report (what `mode: auto` would deploy), printed in
    # full to stderr; stdout: the schedule's text, or where the proposal is mode linear (DFLASH fastest at one
    # request) the schedule of the tree-verify runs alone (so a call can serve DDTREE's best beside DFLASH)
    f=${1:?BENCH_JSON}
    python3 - "$f" <<'PY'
import json, sys
from sglang_ddtree import contract
from sglang_ddtree_tools.report import propose_schedule
runs = json.load(open(sys.argv[1]))["runs"]
p = propose_schedule(runs)
print(json.dumps(p, indent=1), file=sys.stderr)
if p["mode"] != contract.TREE_VERIFY:
    p = propose_schedule(runs, usable=lambda r: contract.deploy_name(r.get("mode")) != contract.LINEAR)
    print("tree-verify runs alone: " + json.dumps(p, indent=1), file=sys.stderr)
if p["budget"] is None:
    sys.exit("no schedule to propose")
print(p["budget"])
PY
    ;;
  replay)
    fam=${1:?FAMILY} budgets=${2:?BUDGETS}
    set -o pipefail
    timeout "${REPLAY_TIMEOUT:-400}" python3 -m sglang_ddtree_tools.replay /tmp/tiny --family "$fam" \
      --budgets "$budgets" --new 128 --device cuda ${PROMPTS:+--prompts "$PROMPTS"} --json "$OUT/replay-$fam.json" \
      2>&1 | tee "$OUT/replay-$fam.txt";;
  matrix)
    # FAMILIES: one or more (space-separated: each family's matrix runs as its own process, side by side - the
    # lossless statistic is not a speed figure, and the two together take the time of one)
    fams=${1:?FAMILIES} budgets=${2:?BUDGETS}
    set -o pipefail
    pids=()
    for fam in $fams; do
      # FAMILY-gN: that family's matrix with SGLANG_DDTREE_GLUE_GRAPHS=N on every server (its own files)
      case "$fam" in *-g[0-2]) glue=${fam##*-g}; base=${fam%-g*};; *) glue=; base=$fam;; esac
      env ${glue:+SGLANG_DDTREE_GLUE_GRAPHS=$glue} \
      timeout "${MATRIX_TIMEOUT:-570}" python3 -m ddtree_checks.serve_matrix --out "/tmp/m-$fam" \
        --work "/tmp/sm-$fam" --pairs /tmp/tiny --block 16 --graphs --budgets $budgets --prompts "${MATRIX_PROMPTS:-64}" --tokens 128 \
        --concurrency 8 --families "$base" --start-timeout "${MATRIX_START_TIMEOUT:-420}" \
        --overlap "${MATRIX_OVERLAP:-default}" \
        --mem-fraction "${MATRIX_MEM_FRACTION:-0.85}" > "$OUT/matrix-$fam.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    for fam in $fams; do
      tail -45 "$OUT/matrix-$fam.log"
      # a matrix cut by its timeout still has every measured server in its partial file
      cp "/tmp/m-$fam/serve_matrix.json" "$OUT/matrix-$fam.json" 2>/dev/null || \
        cp "/tmp/m-$fam/partial-${fam%-g[0-2]}.json" "$OUT/matrix-$fam.json" 2>/dev/null
      cp "/tmp/m-$fam/serve_matrix.txt" "$OUT/matrix-$fam.txt" 2>/dev/null
    done
    stop_servers
    exit $rc;;
  *) echo "unknown step $step" >&2; exit 2;;
esac
