"""zipccl against ZipNN (1 thread) per data and dtype, encode / decode, from codec benchmark JSONs."""
import json, sys
for f in sys.argv[1:]:
    rows = json.load(open(f))
    by = {(r["data"], r["dtype"], r["codec"]): r for r in rows}
    out = []
    for (data, dt, codec), r in by.items():
        if codec != "zipccl-lossless":
            continue
        z = by.get((data, dt, "zipnn-1thread"))
        if z:
            out.append(f"{data[:6]} {dt} {r['encode_GBps'] / z['encode_GBps']:.2f}/{r['decode_GBps'] / z['decode_GBps']:.2f}")
    print(f.split("/")[-1], " | ".join(out))
