"""Each backward branch of a SASS listing (cuobjdump -sass): the loop it closes, its instruction count by opcode."""
import re, sys, collections
sass = open(sys.argv[1]).read()
lines = [l for l in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", l)]
addr = lambda l: int(re.search(r"/\*([0-9a-f]{4,})\*/", l).group(1), 16)
# backward branches: BRA target < own address
for l in lines:
    m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(?:0x)?([0-9a-f]+)?", l)
    t = re.search(r"BRA.*?(0x[0-9a-f]+)", l)
    if "BRA" in l and t:
        tgt, src = int(t.group(1), 16), addr(l)
        if tgt < src:
            body = [x for x in lines if tgt <= addr(x) <= src]
            ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", x).group(1) for x in body)
            print(f"loop {tgt:#x}-{src:#x}: {len(body)} instrs", dict(ops.most_common(30)))
