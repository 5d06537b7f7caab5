"""Links into the service (``make serve``) that stages put in what they report. Pure."""

from __future__ import annotations


def clip_url(service_url: str, video_id: str, start_s: float | None, end_s: float | None) -> str:
    """Where the service plays a video from the evidence's start (to its end): its file endpoint with a media
    fragment, which a browser's player honours."""
    url = f"{service_url}/api/videos/{video_id}/file"
    if start_s is None:
        return url
    return url + f"#t={start_s:g}" + (f",{end_s:g}" if end_s is not None else "")
