#!/usr/bin/python3
"""LAB STAND-IN for `nvidia-smi` -- the only fake in the lab.

Lab hosts have no GPU. This program replays the output that the real `nvidia-smi` printed on a
real host (or a persona derived from such a capture, see DERIVED.txt beside the data) for the
flags it was captured with. Anything it has no capture for fails loudly instead of inventing
output. Data lives in /usr/local/share/lab-gpu-persona/.
"""
import csv
import io
import os
import sys

DATA = os.environ.get("LAB_GPU_PERSONA", "/usr/local/share/lab-gpu-persona")


def cat(name):
    with open(os.path.join(DATA, name)) as fh:
        sys.stdout.write(fh.read())
    return 0


def query_gpu(fields, fmt):
    rows = list(csv.reader(io.StringIO(open(os.path.join(DATA, "query-gpu.csv")).read()), skipinitialspace=True))
    header = [h.strip() for h in rows[0]]
    bare = [h.split(" [")[0] for h in header]
    opts = set(fmt.split(",")[1:])
    idx = []
    for f in fields.split(","):
        if f not in bare:
            sys.stderr.write('Field "%s" is not a valid field to query (lab stand-in has no capture of it).\n' % f)
            return 2
        idx.append(bare.index(f))
    out = []
    if "noheader" not in opts:
        out.append(", ".join(header[i] if "nounits" not in opts else bare[i] for i in idx))
    for r in rows[1:]:
        vals = [r[i].strip() for i in idx]
        if "nounits" in opts:
            vals = [v[:-4] if v.endswith(" MiB") else v for v in vals]
        out.append(", ".join(vals))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def main(argv):
    if not argv:
        return cat("nvidia-smi.txt")
    if sorted(argv) == ["-q", "-x"] or argv == ["-qx"]:
        return cat("nvidia-smi-q.xml")
    if argv == ["topo", "-m"]:
        return cat("topo.txt")
    if argv == ["-L"]:
        rows = list(csv.reader(open(os.path.join(DATA, "query-gpu.csv")), skipinitialspace=True))[1:]
        for r in rows:
            print("GPU %s: %s (UUID: %s)" % (r[0].strip(), r[2].strip(), r[1].strip()))
        return 0
    q = [a for a in argv if a.startswith("--query-gpu=")]
    f = [a for a in argv if a.startswith("--format=")]
    if q and f and len(argv) == 2 and f[0].split("=", 1)[1].split(",")[0] == "csv":
        return query_gpu(q[0].split("=", 1)[1], f[0].split("=", 1)[1])
    sys.stderr.write("lab nvidia-smi stand-in: no capture for arguments %r\n" % (argv,))
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
