import sys

BENCHES = {
    "cache": "sglang_dsv4_ascend.bench.cache",
    "spec": "sglang_dsv4_ascend.bench.spec",
    "serve": "sglang_dsv4_ascend.bench.serve",
    "headline": "sglang_dsv4_ascend.bench.headline",
    "sps": "sglang_dsv4_ascend.bench.sps",
    "step": "sglang_dsv4_ascend.bench.step",
    "w8a8": "sglang_dsv4_ascend.bench.w8a8",
    "prefix": "sglang_dsv4_ascend.bench.prefix",
    "indexcache": "sglang_dsv4_ascend.bench.indexcache",
    "pd": "sglang_dsv4_ascend.bench.pd",
    "startup": "sglang_dsv4_ascend.bench.startup",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m sglang_dsv4_ascend.bench {{{'|'.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
