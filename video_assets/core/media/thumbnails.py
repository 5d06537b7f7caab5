"""A JPEG of the frame at a time: one PyAV seek to the keyframe before, decode up to the time."""

from __future__ import annotations

import io

import av


def frame_jpeg(source, t: float, width: int = 320, quality: int = 80) -> bytes:
    """The first frame at or after ``t`` seconds (the last one when ``t`` is past the end), scaled to
    ``width`` pixels wide, as JPEG bytes. ``source``: a path or a seekable binary stream."""
    with av.open(source) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if t > 0 and stream.time_base:
            try:
                container.seek(int(t / stream.time_base), stream=stream, backward=True, any_frame=False)
            except av.error.FFmpegError:
                container.seek(0)
        chosen = None
        try:
            for frame in container.decode(stream):
                chosen = frame
                if frame.time is None or frame.time >= t - 1e-3:
                    break
        except av.error.FFmpegError:
            pass
        if chosen is None:
            raise ValueError("no decodable frame")
        img = chosen.to_image()
    height = max(1, round(img.height * width / img.width))
    buf = io.BytesIO()
    img.convert("RGB").resize((width, height)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
