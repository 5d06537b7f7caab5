"""A JPEG of the frame at a time: one PyAV seek to the keyframe before, decode up to the time.

Times are seconds from the first presentation time of the video stream, as everywhere in the tables
(``media.sampling``), and the frame is turned upright by its display rotation, as the VLM saw it."""

from __future__ import annotations

import io

import av
from PIL import Image

from video_assets.core.media.sampling import apply_rotation
from video_assets.core.media.streams import start_s


def frame_jpeg(source, t: float, width: int = 320, quality: int = 80) -> bytes:
    """The first frame at or after ``t`` seconds (the last one when ``t`` is past the end), upright,
    scaled to ``width`` pixels wide, as JPEG bytes. ``source``: a path or a seekable binary stream."""
    with av.open(source) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        at = t + start_s(stream)  # the stream's own clock
        if t > 0 and stream.time_base:
            try:
                container.seek(int(at / stream.time_base), stream=stream, backward=True, any_frame=False)
            except av.error.FFmpegError:
                container.seek(0)
        chosen = None
        try:
            for frame in container.decode(stream):
                chosen = frame
                if frame.time is None or frame.time >= at - 1e-3:
                    break
        except av.error.FFmpegError:
            pass
        if chosen is None:
            raise ValueError("no decodable frame")
        img = Image.fromarray(apply_rotation(chosen.to_ndarray(format="rgb24"), int(chosen.rotation or 0)))
    height = max(1, round(img.height * width / img.width))
    buf = io.BytesIO()
    img.resize((width, height)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
