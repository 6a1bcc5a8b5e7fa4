"""Presentation: rich terminal tables, Markdown, HTML and plots of the documents. The only
layer that imports rich and matplotlib."""
