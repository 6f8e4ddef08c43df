// Identifiers wrap at their joints, never mid-word. Browsers break code only at spaces: a
// table's column then had to either widen the table past the page or split
// `InputMismatchError` in two, and so did a line too narrow for a whole identifier. Here a
// <wbr> (a line-break opportunity that copies as nothing) follows each ".", "_", "/", "(",
// "[" and "," inside a name (not at its ends, nor before a closing bracket): always in the
// code of tables and in the API page's object names, and elsewhere only in an identifier that
// did not fit on a line (one that fits still moves to the next line whole), checked on load
// and after each resize.
const joint = /(?<=[^\s._/([,])([._/([,])(?=[^\s._/([,)\]])/g;

function addJoints(element) {
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  const texts = [];
  for (let node; (node = walker.nextNode()); ) texts.push(node);
  for (const text of texts) {
    // split() with a capture group alternates: text, joint, text, joint, ..., text.
    const parts = text.data.split(joint);
    if (parts.length === 1) continue;
    const pieces = [];
    parts.forEach((part, i) => {
      if (part) pieces.push(part);
      if (i % 2 === 1) pieces.push(document.createElement("wbr"));
    });
    text.replaceWith(...pieces);
  }
}

// An element already given its joints is marked, so that a second pass leaves it alone.
function wrapCode() {
  const narrow = "td code, th code, .doc-object-name";
  for (const element of document.querySelectorAll(`.md-typeset :not(pre) > code, ${narrow}`)) {
    if (element.dataset.joints) continue;
    const split = !/\s/.test(element.textContent) && element.getClientRects().length > 1;
    if (split || element.matches(narrow)) {
      addJoints(element);
      element.dataset.joints = "1";
    }
  }
}

// On load, and again when the window narrows (a phone turned, a window resized): a name that
// fitted its line at the first width may not at the next.
document$.subscribe(wrapCode);
let pending = null;
window.addEventListener("resize", () => {
  cancelAnimationFrame(pending);
  pending = requestAnimationFrame(wrapCode);
});
