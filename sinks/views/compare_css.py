"""The style of the compare and search pages of ``rlpulse ui`` (appended to the ui's one stylesheet)."""

CSS = """
main:has(> .compare) { max-width: none; }
.compare-charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 620px), 1fr)); gap: 8px; }
.compare-charts svg.chart { max-width: none; margin: 0; }
table.compare-runs td { vertical-align: middle; } table.compare-runs td.label { font-weight: 600; }
svg.swatch { vertical-align: middle; }
table.config-diff th[data-run] { white-space: nowrap; }
table.config-diff tbody th { font-family: monospace; font-weight: normal; }
table.config-diff td { font-family: monospace; word-break: break-all; max-width: 320px; }
table.config-diff tr.differs td.set { background: #fff8c5; } table.config-diff tr.same td { color: #57606a; }
form.compare-form .compare-hint { margin: 6px 0; }
table.runs td.pick { text-align: center; }
table.hits td.preview { font-size: 12px; max-width: 520px; overflow-wrap: anywhere; color: #3d444d; }
table.hits td.preview mark { background: #fff1a8; padding: 0 1px; }
table.hits td.status-ERROR { color: #cf222e; font-weight: bold; }
form.filters.search input[type=search] { width: 220px; }
@media print { header, form.filters, form.compare-form .compare-hint, footer { display: none; }
  .compare-charts { grid-template-columns: 1fr 1fr; } }
"""
