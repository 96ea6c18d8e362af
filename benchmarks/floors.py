"""Print the roofline floor of every benchmark case: max(bytes / 4.25 TB/s, flops / 750 TFLOP/s)."""
from cases import cases

from mdsl.search.cost import roofline_floor

if __name__ == "__main__":
    print("| case | bytes moved (MB) | GFLOP | floor (us) | bound |")
    print("|---|---:|---:|---:|---|")
    for name, kernel in cases().items():
        f = roofline_floor(kernel.graph)
        print(f"| {name} | {f.bytes / 1e6:.3f} | {f.flops / 1e9:.3f} | {f.seconds * 1e6:.2f} | {f.bound} |")
