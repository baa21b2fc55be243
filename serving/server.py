"""Serve a registered encoder over HTTP: MLflow's scoring app, verified first, bounded.

    python -m serving.server --tracking-uri sqlite:///runs/x/mlflow.db \\
        --model models:/cluttered-encoder@champion [--port 5001] [--path-root /data/images]

(``launch/serve.sh`` wraps it.) Before anything of the version runs, every file of it,
the pyfunc's code included, is downloaded and checked against the SHA-256 digests
recorded in the tracking store at registration (:func:`registry.versions.
fetch_verified`); a file that differs stops the server with one line naming it. Then
MLflow loads the verified local copy (``mlflow.pyfunc.load_model``), its scoring app is
built as ``mlflow models serve`` builds it (``scoring_server.init``, with its request
timeout, ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT``), and :class:`serving.guard.RequestGuard`
wraps it; uvicorn serves the result. The bounds are :class:`serving.limits.ServeLimits`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.cli import reported_faults
from core.errors import RunError
from registry.package import RegistryError
from registry.versions import fetch_verified, resolve
from serving.guard import RequestGuard
from serving.limits import MIB, ServeLimits
from serving.paths import check_root

REQUEST_TIMEOUT = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ServeLimits]:
    defaults = ServeLimits()
    parser = argparse.ArgumentParser(prog="serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", required=True,
                        help="the run's store: sqlite:///path/mlflow.db or http://host:port")
    parser.add_argument("--model", required=True,
                        help="models:/name/<version|latest>, models:/name@alias or "
                             "runs:/id/encoder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--path-root", default=defaults.path_root,
                        help="serve path rows from regular files under this directory "
                             "(default: path rows are refused)")
    parser.add_argument("--max-body-mib", type=float, default=defaults.max_body_bytes / MIB,
                        help="larger request bodies are answered 413 before they are read")
    parser.add_argument("--max-rows", type=int, default=defaults.max_rows)
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels,
                        help="pixels decoded per request, judged from the image headers")
    parser.add_argument("--max-file-mib", type=float, default=defaults.max_file_bytes / MIB,
                        help="the largest file a path row may name")
    parser.add_argument("--deadline-s", type=float, default=defaults.deadline_s,
                        help="a request still decoding after this is refused")
    parser.add_argument("--concurrent", type=int, default=defaults.concurrent,
                        help="requests decoding at once")
    args = parser.parse_args(argv)
    try:
        limits = ServeLimits(
            max_body_bytes=int(args.max_body_mib * MIB), max_rows=args.max_rows,
            max_pixels=args.max_pixels, max_file_bytes=int(args.max_file_mib * MIB),
            deadline_s=args.deadline_s, concurrent=args.concurrent,
            path_root=check_root(args.path_root) if args.path_root else "")
    except (ValueError, RunError) as err:
        parser.exit(2, f"serve: configuration error: {err}\n")
    return args, limits


def verified_model(model_uri: str, tracking_uri: str, directory: Path) -> Any:
    """The version's pyfunc, loaded by MLflow from a local copy whose every file matched
    its registered digest."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    ref, record = resolve(model_uri, tracking_uri, key="--model")
    label = f"models:/{ref.name}/{ref.version}" if ref.version else model_uri
    local = fetch_verified(ref.storage or model_uri, tracking_uri, record, directory, label)
    try:
        return mlflow.pyfunc.load_model(str(local))
    except Exception as err:
        raise RegistryError(f"{label}: its files verify but MLflow does not load them "
                            f"({str(err).splitlines()[0][:200] if str(err) else err})") from None


def build_app(model: Any, limits: ServeLimits) -> RequestGuard:
    """MLflow's scoring app for ``model`` (configured with ``limits``), behind the guard."""
    from mlflow.pyfunc import scoring_server

    model.unwrap_python_model().configure(limits)
    return RequestGuard(scoring_server.init(model), limits)


def main(argv: Sequence[str] | None = None) -> None:
    args, limits = parse(argv)
    os.environ.setdefault(REQUEST_TIMEOUT, str(int(limits.deadline_s * 2)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    import uvicorn

    with reported_faults("serve"), tempfile.TemporaryDirectory(prefix="serve-") as tmp:
        app = build_app(verified_model(args.model, args.tracking_uri, Path(tmp)), limits)
        logging.getLogger("serving").info(
            "serving %s on %s:%d (path rows: %s)", args.model, args.host, args.port,
            limits.path_root or "off")
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
