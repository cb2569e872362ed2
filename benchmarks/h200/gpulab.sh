#!/usr/bin/env bash
# The GPU lab on a machine with an NVIDIA GPU and no package registry (the lent H200), driven by `fab` itself.
#
#   prepare            here, after `fab lab.up` built the lab's Debian base: writes .gpulab/control.tar.xz, the
#                      control chroot: the lab base (bookworm) with systemd-nspawn (systemd-container) and a venv
#                      /opt/ddtree-control holding ddtree-deploy's own dependencies (fabric, rich, ...), from PyPI.
#   up                 there, from the repository root, as root: unpacks the control chroot into /tmp/gl/base,
#                      binds the machine's root (/machine), this checkout (/src), the models (/kit: $KIT, default
#                      /tmp/tiny) and the kernel's file systems into it, and runs `fab lab.up --gpu` inside it:
#                      gpu-ref and gpu-drift boot over the machine's own root with its GPUs (deploy/lab/gpuhost.py).
#   sglang BATCH...    there: installs the wheel batches (benchmarks/h200/batches.sh: .gpu/A .gpu/B .gpu/C) into
#                      gpu-ref's managed venv (/opt/torch/.venv, the machine's own torch) through its sshd, the
#                      reference's SGLang 0.5.17; gpu-drift keeps the machine's venv as it is (no SGLang,
#                      transformers 5.17, which SGLang 0.5.17's model configs fail on: a real drift).
#   fab ARGS...        there: `fab ARGS` inside the control chroot against inventory/gpulab.yaml (INV=FILE: another
#                      inventory, e.g. inventory/gpulab-leaky.yaml; BUDGET=N, MODE=M [CONCURRENCY=N]: that inventory
#                      with the fleet's budget or mode changed); its output is kept under $OUT/fab-<n>.txt.
#   load ARGS...       there: benchmarks/load_during.py ARGS in the control chroot (streaming load through the
#                      hosts' routers while a `fab` command runs; same INV and BUDGET); output $OUT/load-<n>.txt.
#   host NAME CMD...   there: CMD on lab host NAME (gpu-ref, gpu-drift) over its sshd, as root; output
#                      $OUT/host-<n>.txt (e.g. `systemd-analyze security sglang-ddtree@gpu0.service`).
#   kit / kitwait [S]  there: trains the kit's hybrid pair on the GPU in the background (FAMILY=hybrid|dense|both,
#                      SEED; a later step's FAMILY=dense serves the dense pair: inventory() below), gives its
#                      models a tokenizer (kit_tokenizer.py) and puts them, readable by the service user, in $KIT;
#                      kitwait waits up to S seconds.
#   down               there: `fab lab.down`, then the chroot's mounts.
# Every step prints what it did; the call sequence and what each took: benchmarks/h200/README.md ("GPU lab").
set -u
cd "$(dirname "$0")/../.."
G=/tmp/gl
B=$G/base
OUT=${OUT:-/tmp/out}
step=${1:?step: prepare, up, kit, kitwait, sglang, fab, load, diag or down}; shift

inventory() {  # the inventory the chroot's fab reads: INV (default inventory/gpulab.yaml), or its copy with the
  # fleet's node budget BUDGET=N and/or mode MODE=M (MODE=auto needs CONCURRENCY=N: what fab bench's result is for)
  # and/or the kit's dense pair in place of its hybrid one (FAMILY=dense; the kit trained with FAMILY=both)
  local inv=${INV:-inventory/gpulab.yaml}
  local fam=
  [ "${FAMILY:-hybrid}" = dense ] && fam=dense
  if [ -n "${BUDGET:-}${MODE:-}$fam" ]; then
    local out=$B/tmp/inventory-${BUDGET:-x}-${MODE:-x}${fam:+-$fam}.yaml
    mkdir -p "$B/tmp"; cp "$inv" "$out"
    if [ -n "$fam" ]; then
      sed -i "s#^\(  [a-z_]*model: /models/\)hybrid-#\1dense-#; s/^  served_model_name: tiny-hybrid/  served_model_name: tiny-dense/" "$out"
      grep -q "^  model: /models/dense-target" "$out" && grep -q "^  draft_model: /models/dense-drafter" "$out" || \
        { echo "no hybrid model lines in $inv" >&2; return 1; }
    fi
    if [ -n "${BUDGET:-}" ]; then
      sed -i "s/^  budget: [0-9]*\( *#.*\)\?$/  budget: $BUDGET/" "$out"
      grep -q "^  budget: $BUDGET$" "$out" || { echo "no budget line in $inv" >&2; return 1; }
    fi
    if [ -n "${MODE:-}" ]; then
      sed -i "s/^  mode: [a-z-]*\( *#.*\)\?$/  mode: $MODE${CONCURRENCY:+\\n  concurrency: $CONCURRENCY}/" "$out"
      grep -q "^  mode: $MODE$" "$out" || { echo "no mode line in $inv" >&2; return 1; }
    fi
    # fab bench keeps its results beside the inventory (bench/HOST/RELEASE.json): the copy reads the original's
    [ -L "$B/tmp/bench" ] || ln -s "/src/$(dirname "$inv")/bench" "$B/tmp/bench"
    inv=${out#"$B"}
  fi
  echo "$inv"
}

in_chroot() {  # command line run inside the control chroot, from /src, with the GPU lab's environment
  chroot "$B" /usr/bin/env -i PATH=/opt/ddtree-control/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    COLUMNS="${COLUMNS:-100}" PYTHONUNBUFFERED=1 DEPLOY_INVENTORY="$(inventory)" \
    DDTREE_GPULAB_MACHINE=/machine DDTREE_GPULAB_MODELS=/kit /bin/sh -c "cd /src && $*"
}

case "$step" in
  prepare)
    set -euo pipefail
    base=$(ls -d /var/cache/ddtree-lab/base-bookworm-* | head -1)
    [ -f "$base/.ddtree-lab-base" ] || { echo "no lab base: run fab lab.up first" >&2; exit 1; }
    grep -qx '/.gpulab/' .git/info/exclude 2>/dev/null || echo '/.gpulab/' >> .git/info/exclude
    w=$(mktemp -d); trap 'umount -R "$w/root/proc" 2>/dev/null || true; rm -rf "$w"' EXIT
    cp -a "$base" "$w/root"
    # systemd-nspawn: its package unpacked aside, then merged into the base's merged /usr (the deb still ships
    # /bin and /lib, which must not replace the base's bin -> usr/bin links)
    (cd "$w" && apt-get download -q systemd-container >/dev/null 2>&1 && dpkg -x systemd-container_*.deb deb)
    for d in bin sbin lib; do [ -d "$w/deb/$d" ] && cp -a "$w/deb/$d/." "$w/root/usr/$d/"; done
    cp -a "$w/deb/usr/." "$w/root/usr/"; [ -d "$w/deb/etc" ] && cp -a "$w/deb/etc/." "$w/root/etc/"
    mkdir -p "$w/root/tmp/whl"
    python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_34_x86_64 -d "$w/root/tmp/whl" \
      "fabric>=3.2,<4" "pyyaml>=6,<7" "jinja2>=3.1,<4" "packaging>=24" "prometheus_client>=0.20,<1" \
      "rich>=13,<16" "setuptools>=68" "wheel>=0.40" pip 2>&1 | grep -v "is ignored: it is neither" || true
    mount -t proc proc "$w/root/proc"
    chroot "$w/root" /bin/sh -c 'python3 -m venv /opt/ddtree-control && \
      /opt/ddtree-control/bin/pip install -q --no-index --find-links /tmp/whl --upgrade pip setuptools wheel && \
      /opt/ddtree-control/bin/pip install -q --no-index --find-links /tmp/whl fabric pyyaml jinja2 packaging \
        prometheus_client rich'
    umount "$w/root/proc"
    rm -rf "$w/root/tmp/whl" "$w/root/usr/share/doc" "$w/root/usr/share/man" "$w/root/usr/share/locale" \
      "$w/root/var/cache/apt" "$w/root/var/lib/apt/lists"
    mkdir -p .gpulab
    (cd "$w/root" && tar c --exclude=./usr/share/zoneinfo --exclude=./usr/share/i18n --exclude='./usr/share/perl*' \
       --exclude='./usr/lib/x86_64-linux-gnu/perl*' --exclude='*/__pycache__' --exclude=./usr/share/info . \
       | xz -T2 -6 > "$OLDPWD/.gpulab/control.tar.xz")
    ls -la .gpulab;;
  up)
    t0=$(date +%s)
    [ -s /etc/machine-id ] || python3 -c "import uuid; print(uuid.uuid4().hex)" > /etc/machine-id
    if [ ! -x "$B/opt/ddtree-control/bin/fab" ]; then
      mkdir -p "$B" && tar xJf .gpulab/control.tar.xz -C "$B" || exit 1
    fi
    # systemd-nspawn reads the machine ID of the system it runs on: the chroot's
    [ -s "$B/etc/machine-id" ] || python3 -c "import uuid; print(uuid.uuid4().hex)" > "$B/etc/machine-id"
    id=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$B/.ddtree-lab-base")
    mkdir -p "$B/machine" "$B/src" "$B/kit" "$B/var/cache/ddtree-lab/base-bookworm-$id" "${KIT:-/tmp/tiny}"
    mnt() { grep -q " ${@: -1} " /proc/self/mounts || mount "$@"; }
    # the chroot's / must be a mount point of its own (ip netns and systemd-nspawn change its propagation)
    if ! grep -q " $B " /proc/self/mounts; then
      for m in $(grep -o " $B/[^ ]*" /proc/self/mounts | sort -r); do umount -l "$m"; done
      mount --bind "$B" "$B"
    fi
    mnt --bind / "$B/machine"
    mnt --bind "$PWD" "$B/src"
    mnt --bind "${KIT:-/tmp/tiny}" "$B/kit"
    mnt --bind "$B" "$B/var/cache/ddtree-lab/base-bookworm-$id"   # the base is the chroot itself
    # the driver's folder, a mount of its own on the machine (a bind of / does not carry it)
    if [ -d /usr/local/nvidia ]; then mkdir -p "$B/usr/local/nvidia"; mnt --bind /usr/local/nvidia "$B/usr/local/nvidia"; fi
    echo "machine mounts under /opt /usr /home:"; awk '$2 ~ "^/(opt|usr|home)" {print "  " $2, $3}' /proc/self/mounts
    mnt -t proc proc "$B/proc"
    grep -q " $B/sys " /proc/self/mounts || mount --rbind /sys "$B/sys"
    grep -q " $B/dev " /proc/self/mounts || mount --rbind /dev "$B/dev"
    mnt -t tmpfs tmpfs "$B/run"
    echo "control chroot ready in $(( $(date +%s) - t0 )) s"
    in_chroot "fab lab.up --gpu" 2>&1 | tee "$OUT/lab-up.txt"
    in_chroot "fab lab.status";;
  sglang)
    root=$B/var/lib/ddtree-lab/hosts/gpu-ref/root
    [ -d "$root/usr" ] || { echo "gpu-ref is not up (gpulab.sh up)" >&2; exit 1; }
    mkdir -p "$root/var/tmp/batches"
    for b in "$@"; do cp "$b"/* "$root/var/tmp/batches/"; done
    cat > "$root/var/tmp/batches/install.sh" <<'SH'
set -e
V=/opt/torch/.venv
S=$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$V/bin/python -m pip install -q --no-index --no-deps --no-compile --upgrade /var/tmp/batches/*.whl 2>&1 \
  | grep -v WARNING | tail -3 || true
# the trimmed sglang-kernel (no FA3: batches.sh) unpacks into site-packages; its RECORD then lists what it holds
for t in /var/tmp/batches/*.tgz; do [ -e "$t" ] && tar xzf "$t" -C "$S"; done; true
$V/bin/python - "$S" <<'PY'
import csv, glob, os, sys
site = sys.argv[1]
for rec in glob.glob(os.path.join(site, "sglang_kernel-*.dist-info/RECORD")):
    rows = [r for r in csv.reader(open(rec)) if r and os.path.exists(os.path.join(site, r[0]))]
    with open(rec, "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
PY
rm -rf /var/tmp/batches
# root runs the venv's python only when nothing in it is writable by group or others (tar kept the trimmed
# kernel's archive modes)
find $V -perm /022 ! -type l -exec chmod go-w {} +
$V/bin/python -c 'import sglang, transformers; print("gpu-ref: sglang", sglang.__version__, "transformers", transformers.__version__)'
SH
    t0=$(date +%s)
    in_chroot "ssh -i /var/lib/ddtree-lab/id_ed25519 -o UserKnownHostsFile=/var/lib/ddtree-lab/known_hosts \
      -o StrictHostKeyChecking=yes -o BatchMode=yes root@10.231.77.10 sh /var/tmp/batches/install.sh"
    echo "sglang installed on gpu-ref in $(( $(date +%s) - t0 )) s";;
  fab)
    n=$(ls "$OUT" 2>/dev/null | grep -c '^fab-'); f=$OUT/fab-$((n + 1))-$(echo "$1" | tr -c 'a-z.\n' '_').txt
    echo "\$ fab $*" > "$f"
    t0=$(date +%s)
    in_chroot "fab $*" 2>&1 | tee -a "$f"; rc=${PIPESTATUS[0]}
    echo "(exit $rc, $(( $(date +%s) - t0 )) s)" | tee -a "$f"
    exit "$rc";;
  load)
    n=$(ls "$OUT" 2>/dev/null | grep -c '^load-'); f=$OUT/load-$((n + 1)).txt
    echo "\$ python benchmarks/load_during.py $*" > "$f"
    in_chroot "python benchmarks/load_during.py $*" 2>&1 | tee -a "$f"; rc=${PIPESTATUS[0]}
    exit "$rc";;
  host)
    name=${1:?host NAME CMD}; shift
    case $name in  # deploy/lab/fleet.py GPU_HOSTS
      gpu-ref) addr=10.231.77.10 ;; gpu-drift) addr=10.231.77.11 ;; *) echo "no GPU lab host $name" >&2; exit 2 ;;
    esac
    n=$(ls "$OUT" 2>/dev/null | grep -c '^host-'); f=$OUT/host-$((n + 1)).txt
    echo "\$ [$name] $*" > "$f"
    in_chroot "ssh -i /var/lib/ddtree-lab/id_ed25519 -o UserKnownHostsFile=/var/lib/ddtree-lab/known_hosts \
      -o StrictHostKeyChecking=yes -o BatchMode=yes root@$addr $(printf '%q ' "$@")" 2>&1 | tee -a "$f"
    exit "${PIPESTATUS[0]}";;
  kit)
    # the training kit's hybrid pair, trained on the machine's GPU in the background (~150 s; a new session, so
    # it outlives the device call that starts it), then given a tokenizer (kit_tokenizer.py) and put in $KIT
    rm -rf /tmp/tiny-build; mkdir -p "${KIT:-/tmp/tiny}"
    setsid nohup sh -c "PYTHONPATH=$PWD/overlays/sglang-ddtree/src:$PWD/overlays/sglang-ddtree-tools/src python3 -m sglang_ddtree_tools.trainkit /tmp/tiny-build \
        --family ${FAMILY:-hybrid} --seed ${SEED:-0} --device cuda --drafter-chain-target 4.0 \
      && python3 benchmarks/h200/kit_tokenizer.py /tmp/tiny-build/*-target /tmp/tiny-build/*-drafter \
      && cp -rL /tmp/tiny-build/. ${KIT:-/tmp/tiny}/ && chmod -R a+rX ${KIT:-/tmp/tiny} && echo KIT-DONE \
      || echo KIT-FAILED" > /tmp/kit.log 2>&1 < /dev/null &
    echo "kit training in the background (log /tmp/kit.log)";;
  kitwait)
    for i in $(seq "${1:-300}"); do grep -qE "KIT-DONE|KIT-FAILED" /tmp/kit.log 2>/dev/null && break; sleep 1; done
    tail -5 /tmp/kit.log; cp /tmp/kit.log "$OUT/trainkit.log" 2>/dev/null; ls "${KIT:-/tmp/tiny}"
    grep -q KIT-DONE /tmp/kit.log;;
  diag)
    # what the hosts said while booting, and their journals' warnings, read from outside
    for d in "$B"/var/lib/ddtree-lab/hosts/*/; do
      echo "== $(basename "$d"): console"; tail -n "${1:-25}" "$d/console.log" 2>/dev/null
    done
    in_chroot "fab lab.journal --lines ${1:-25}";;
  down)
    in_chroot "fab lab.down"
    for m in $(grep -o " $B[^ ]*" /proc/self/mounts | sort -r); do umount -l "$m"; done
    echo "down";;
  *) echo "unknown step $step" >&2; exit 2;;
esac
