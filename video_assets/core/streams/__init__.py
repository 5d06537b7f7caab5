"""Live cameras: streams as configuration, recorded into the volume as segments the upload sensor registers."""
