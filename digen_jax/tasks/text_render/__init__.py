"""Text rendering: prompts that ask for a quoted text in the image, scored by OCR."""
