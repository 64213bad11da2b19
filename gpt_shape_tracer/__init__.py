"""The installed front doors: the ``gpt-shape-tracer`` command (``app`` starts the Streamlit page,
``trace`` traces a generation headless and writes the file) and the process-wide choices a front end
makes for itself (``memory``: the allocator keeps freed memory for reuse). Libraries (``model``,
``tracer``, ``figures``) never import this package."""
