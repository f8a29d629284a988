"""Floor 6, reports, built from records alone (never from a live session): the JSON record and
its Markdown digest (report), the HTML page (html_report), the files beside each other
(report_files), `difftest report`/`bundle` (bundle), the end-of-session summary (upgrade) and the
release table (version_table)."""
