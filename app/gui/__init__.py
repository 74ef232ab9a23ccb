"""The desktop GUI (Gradio): `miniapp` or `miniapp gui`."""
