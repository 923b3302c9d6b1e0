"""Where a pick's time goes: ``cProfile`` around ``api.pick_result`` on the fake 8-GPU fleet,
set up as ``benchmarks/pick_latency.py`` sets it up (the same options, a lease on a fresh
shared-directory registry, released between calls, outside the profile).

    .venv/bin/python benchmarks/pick_profile.py [--repeat 300] [--top 25] [--sort tottime]
        [--magic]

``--magic`` profiles ``%gpu pick`` through ``InteractiveShell.run_line_magic`` instead.

Prints the ``--top`` entries of the profile (own time by default; ``--sort cumulative`` for the
call tree's view) and the share of the total each one takes. Times under a profiler are inflated
(several times for code that makes many small calls): read the shares, not the milliseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIN_FREE = "10G"
MAX_UTIL = 50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"))
    parser.add_argument("--magic", action="store_true", help="profile %%gpu pick instead")
    args = parser.parse_args()

    from tests.fakenvml import FakeNvml, fleet_8x, preload_fake_nvml

    tmp = Path(tempfile.mkdtemp(prefix="autogpu-profile-"))
    preload_fake_nvml()
    fake = FakeNvml(tmp / "nvml")
    fake.write(fleet_8x())
    os.environ["FAKE_NVML_SCENARIO"] = str(fake.scenario_path)
    os.environ["AUTOGPU_REGISTRY_DIR"] = str(tmp / "registry")
    for name in ("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        os.environ.pop(name, None)

    from autogpu_jupyter import api
    from autogpu_jupyter.config import default_settings
    from autogpu_jupyter.core import session

    def ours() -> object:  # what benchmarks/pick_latency.py times as api.pick_result
        values = {"min_free": MIN_FREE, "max_util": MAX_UTIL}
        opts = api.pick_options(default_settings(), values)
        return api.pick_result(opts, dry_run=False)

    if args.magic:
        import contextlib
        import io

        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        cfg = Config()
        cfg.HistoryManager.hist_file = ":memory:"
        shell = InteractiveShell.instance(config=cfg)
        shell.run_line_magic("load_ext", "autogpu")
        sink = io.StringIO()

        def ours() -> object:  # what benchmarks/pick_latency.py times as %gpu pick
            with contextlib.redirect_stdout(sink):
                shell.run_line_magic("gpu", f"pick --min-free {MIN_FREE} --max-util {MAX_UTIL}")
            sink.seek(0)
            sink.truncate()
            return None

    ours()  # NVML init and the first handles, outside the profile
    session.release()
    profiler = cProfile.Profile()
    for _ in range(args.repeat):
        profiler.enable()
        ours()
        profiler.disable()
        session.release()
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    what = "%gpu pick" if args.magic else "api.pick_result"
    print(f"{args.repeat} x {what} under cProfile: {total * 1000 / args.repeat:.3f} ms per pick")
    key = 2 if args.sort == "tottime" else 3
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][key], reverse=True)  # type: ignore[attr-defined]
    print(f"{'share':>6} {'own ms':>8} {'cum ms':>8} {'calls':>7}  function")
    for (filename, line, func), (_cc, ncalls, tt, ct, _callers) in rows[: args.top]:
        where = filename.replace(str(REPO) + os.sep, "")
        if "site-packages" in where:
            where = where.split("site-packages" + os.sep, 1)[1]
        share = (tt if key == 2 else ct) / total * 100
        print(
            f"{share:5.1f}% {tt * 1000 / args.repeat:8.3f} {ct * 1000 / args.repeat:8.3f} "
            f"{ncalls // args.repeat:7d}  {where}:{line}({func})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
