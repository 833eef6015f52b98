"""Views of programs for people: an HTML page of the sharded program (``html.py``)."""

from .html import render_html, sharded_programs, write_html
from .program_data import program_data

__all__ = ["program_data", "render_html", "sharded_programs", "write_html"]
