"""Speech in a video to timed text: decode its audio track, transcribe it with Whisper, shape the rows."""
