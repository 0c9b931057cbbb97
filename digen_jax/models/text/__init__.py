"""Text encoders (the TextEncoder interface, the word encoder), the per-prompt embedding
cache (format, writer, reader) and the identity that keys it."""
