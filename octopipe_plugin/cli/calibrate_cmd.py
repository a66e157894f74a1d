"""`octopipe calibrate PROFILE...`: analytic against measured per layer kind; --write fits the calibration data."""

from __future__ import annotations

from ..errors import OctoPipeError
from ..formats.model import read_model


def add_parser(subparsers) -> None:
    """Register `octopipe calibrate`."""
    p = subparsers.add_parser(
        "calibrate", help="analytic vs measured F/I/W per kind; fit the analytic model's efficiency from profiles",
        description="Compare profiled models (octopipe profile -o) with the analytic model per layer kind, and with "
                    "--write add them to the calibration data the analytic model reads (costs/calibration.json or "
                    "$OCTOPIPE_CALIBRATION), so `octopipe model --gpu G` uses the measured efficiency per kind.")
    p.add_argument("profiles", nargs="*", help="octopipe-model/1 files written by `octopipe profile`")
    p.add_argument("--gpu", help="GPU of the table the profiles belong to (default: the profiled device's)")
    p.add_argument("--write", action="store_true", help="add the profiles' samples to the calibration data")
    p.add_argument("--file", help="calibration data file (default: $OCTOPIPE_CALIBRATION or the shipped one)")
    p.add_argument("--show", action="store_true", help="print the calibration data per GPU and kind")
    p.set_defaults(run=run)


def run(args) -> int:
    """Print the per-kind comparison of each profile, write the fit if asked, show the data if asked."""
    from ..costs.calibration import calibration_path, read_document
    from ..profile.calibration import compare, fit, format_comparison, format_document, profile_gpu, write_document

    if not args.profiles and not args.show:
        raise OctoPipeError("give profiled model files (octopipe profile ... -o FILE) or --show")
    if args.write and not args.profiles:
        raise OctoPipeError("--write needs profiled model files")
    models = [read_model(path) for path in args.profiles]
    for path, model in zip(args.profiles, models):
        gpu = profile_gpu(model, args.gpu)
        title = f"{path}: {model.name} on {model.meta.get('profile', {}).get('device', '?')} vs analytic {gpu} (ms)"
        print(format_comparison(compare(model, gpu), title))
    target = args.file or calibration_path()
    if args.write:
        doc = fit(models, args.gpu, read_document(target))
        print(f"wrote {write_document(doc, target)}")
    if args.show or args.write:
        print(format_document(read_document(target)))
    return 0
