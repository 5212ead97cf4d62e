// One MathJax 3 for the whole site.
// Markdown pages: pymdownx.arithmatex wraps each formula in an element of class "arithmatex".
// Notebook pages: nbconvert leaves $...$ and $$...$$ as text inside the rendered Markdown cells.
// Everything else (code cells, outputs, navigation) is left alone, so a "$" in code is never typeset.
// MathJax skips an element whose class matches ignoreHtmlClass, and everything inside it, except inside an
// element whose class matches processHtmlClass. So: skip the page's header and main container, and take back
// the arithmatex formulas and the notebook's Markdown cells, including the paragraphs and lists inside them.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: "md-header|md-container|mathjax_ignore|tex2jax_ignore",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown|jp-RenderedLatex",
  },
};

// Typeset again after Material swaps the page in place (instant navigation).
// Without network access MathJax never loads; the page then shows the TeX source.
document$.subscribe(() => {
  if (window.MathJax && typeof MathJax.typesetPromise === "function") {
    MathJax.startup.output.clearCache();
    MathJax.typesetClear();
    MathJax.texReset();
    MathJax.typesetPromise();
  }
});
