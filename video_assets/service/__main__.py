"""`python -m video_assets.service --index DIR --text-model DIR [--frame-model DIR] [--tables DIR]`: the
service on explicit folders (no MLflow lookup; `video-assets serve` resolves them from the registry)."""

from __future__ import annotations

import argparse
import sys

from video_assets.service.server import DEFAULT_HOST, DEFAULT_PORT, IndexMissing, build_searcher, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m video_assets.service", description=__doc__)
    p.add_argument("--index", required=True, help="LanceDB search index URI")
    p.add_argument("--text-model", required=True, help="sentence-transformers folder (the index's text encoder)")
    p.add_argument("--text-version", default=None, help="encoder version of the indexed rows (default: the only one)")
    p.add_argument("--frame-model", default=None, help="frame encoder folder, for image uploads")
    p.add_argument("--tables", default=None, help="Delta tables root (raw_videos: thumbnails and files)")
    p.add_argument("--llm-base-url", default=None, help="OpenAI-compatible endpoint for /api/ask (default: none)")
    p.add_argument("--llm-model", default="", help="model the endpoint serves (default: the first it lists)")
    p.add_argument(
        "--review-token-file",
        default=None,
        help="file holding the reviewer token the review page's writes need (default: none, writes refused)",
    )
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = p.parse_args(argv)
    try:
        searcher = build_searcher(args.index, args.text_model, args.frame_model, args.text_version)
    except IndexMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tables = None
    if args.tables:
        from resources.delta import DeltaTables

        tables = DeltaTables(root_uri=args.tables)
    from video_assets.core.qa.llm import LlmClient
    from video_assets.service.app import create_app

    llm = LlmClient(args.llm_base_url, args.llm_model) if args.llm_base_url else None
    token = open(args.review_token_file).read().strip() if args.review_token_file else None
    from resources.settings import dagster_home_set

    on_write = None
    if dagster_home_set():  # an instance to tell: saved labels are materialisations of review_labels
        from video_assets.defs.reports import report_write as on_write
    serve(create_app(searcher, tables=tables, llm=llm, review_token=token, on_write=on_write), args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
