"""What to build and when: serving config, capture shapes, warm plan, warm, capture hook and CLI."""
