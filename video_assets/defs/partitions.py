from dagster import DynamicPartitionsDefinition

# One partition per upload batch; keys are added by the upload sensor or `video-assets register`.
video_batches = DynamicPartitionsDefinition(name="video_batches")
