// A small Markdown renderer for model output that never parses markup.
//
// Model text reaches the page only as text nodes: the renderer builds elements itself, with
// tag names from ALLOWED_TAGS and attributes it sets (a link's href only when safeHref accepts
// it), so a `<script>`, an `<img onerror>` or a `javascript:` link in the text stays text. It
// reads: fenced code blocks, headings, lists, rules and paragraphs; inline code (any backtick
// run, closed by a run of the same length), bold, italic, links and hard line breaks.
// Every search for a closing marker is remembered per marker, so a paragraph costs time
// linear in its length times the nesting depth (at most MAX_DEPTH), however hostile.

export const ALLOWED_TAGS = Object.freeze([
  "a", "br", "code", "em", "h3", "h4", "h5", "hr", "li", "ol", "p", "pre", "strong", "ul",
]);
const MAX_DEPTH = 8;
const SAFE_HREF = /^(?:https?:\/\/|mailto:)[^\s\u0000-\u001f\u007f]+$/i;
const ESCAPABLE = "\\`*_[]()#+-.!<>~|{}";
const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*)$/;
const LIST_ITEM = /^[ \t]*([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
const RULE = /^ {0,3}(?:-[ \t]*){3,}$|^ {0,3}(?:\*[ \t]*){3,}$|^ {0,3}(?:_[ \t]*){3,}$/;
const CODE_LANG = /^[\w+#.-]{1,32}$/;

/** `url` if a link may point there (http, https or mailto, no spaces or controls), else null. */
export function safeHref(url) {
  const trimmed = url.trim();
  return SAFE_HREF.test(trimmed) ? trimmed : null;
}

/** `text` as a DocumentFragment of ALLOWED_TAGS elements and text nodes, built with `doc`. */
export function renderMarkdown(text, doc = globalThis.document) {
  const out = doc.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      i = appendCodeBlock(out, lines, i, fence, doc);
    } else if (line.trim() === "") {
      i += 1;
    } else if (RULE.test(line)) {
      out.appendChild(doc.createElement("hr"));
      i += 1;
    } else if (HEADING.test(line)) {
      const [, hashes, title] = HEADING.exec(line);
      const heading = doc.createElement(`h${Math.min(hashes.length + 2, 5)}`);
      appendInline(heading, withoutClosingHashes(title), doc, 0);
      out.appendChild(heading);
      i += 1;
    } else if (LIST_ITEM.test(line)) {
      i = appendList(out, lines, i, doc);
    } else {
      const start = i;
      while (i < lines.length && lines[i].trim() !== "" && (i === start || !startsBlock(lines[i]))) i += 1;
      const paragraph = doc.createElement("p");
      appendInline(paragraph, lines.slice(start, i).join("\n"), doc, 0);
      out.appendChild(paragraph);
    }
  }
  return out;
}

/** A heading's text without its optional closing `#`s (`## C#` keeps its `#`); no regex, so
 * linear on any line. */
function withoutClosingHashes(title) {
  let end = title.trimEnd().length;
  let hashes = end;
  while (hashes > 0 && title[hashes - 1] === "#") hashes -= 1;
  if (hashes < end && (hashes === 0 || title[hashes - 1] === " " || title[hashes - 1] === "\t")) end = hashes;
  return title.slice(0, end).trimEnd();
}

function startsBlock(line) {
  return FENCE.test(line) || RULE.test(line) || HEADING.test(line) || LIST_ITEM.test(line);
}

/** A fenced block from line `i`; an unclosed fence (a stream still writing) runs to the end. */
function appendCodeBlock(out, lines, i, fence, doc) {
  const [, marker, lang] = fence;
  const body = [];
  let j = i + 1;
  for (; j < lines.length; j += 1) {
    const close = lines[j].trim();
    if (close.length >= marker.length && close === marker[0].repeat(close.length)) break;
    body.push(lines[j]);
  }
  const pre = doc.createElement("pre");
  const code = doc.createElement("code");
  if (CODE_LANG.test(lang)) code.setAttribute("class", `language-${lang}`);
  code.appendChild(doc.createTextNode(body.join("\n")));
  pre.appendChild(code);
  out.appendChild(pre);
  return j + 1;
}

/** Consecutive list items from line `i` (one level; indented items join the same list). */
function appendList(out, lines, i, doc) {
  const first = LIST_ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[1][0]);
  const list = doc.createElement(ordered ? "ol" : "ul");
  const start = ordered ? Number.parseInt(first[1], 10) : 1;
  if (ordered && start !== 1) list.setAttribute("start", String(start));
  const items = [];
  while (i < lines.length) {
    const item = LIST_ITEM.exec(lines[i]);
    if (item) {
      items.push([item[2]]);
    } else if (lines[i].trim() !== "" && /^[ \t]/.test(lines[i]) && !FENCE.test(lines[i])) {
      items[items.length - 1].push(lines[i].trim()); // a continuation line of the item
    } else {
      break;
    }
    i += 1;
  }
  for (const item of items) {
    const li = doc.createElement("li");
    appendInline(li, item.join("\n"), doc, 0);
    list.appendChild(li);
  }
  out.appendChild(list);
  return i;
}

/** Finds closing markers after a position, remembering each marker's last answer: the first
 * valid closer at or after `from` only moves forward as `from` does. */
class Closers {
  constructor(text) {
    this.text = text;
    this.memo = new Map();
  }

  find(needle, from, isValid) {
    const seen = this.memo.get(needle);
    if (seen && seen.from <= from && (seen.at === -1 || seen.at >= from)) return seen.at;
    let at = this.text.indexOf(needle, from);
    while (at !== -1 && !isValid(at)) at = this.text.indexOf(needle, at + 1);
    this.memo.set(needle, { from, at });
    return at;
  }
}

const isSpace = (c) => c === undefined || /\s/.test(c);
const isWordChar = (c) => c !== undefined && /[\p{L}\p{N}]/u.test(c);

/** The inline Markdown of `text` appended to `parent`; `depth` bounds nesting. */
function appendInline(parent, text, doc, depth, inLink = false) {
  const closers = new Closers(text);
  let plain = "";
  const flush = () => {
    if (plain) parent.appendChild(doc.createTextNode(plain));
    plain = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === "\\" && ESCAPABLE.includes(text[i + 1] ?? "x")) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "\n") {
      flush();
      parent.appendChild(doc.createElement("br"));
      i += 1;
      continue;
    }
    if (c === "`") {
      let n = 1;
      while (text[i + n] === "`") n += 1;
      const run = "`".repeat(n);
      const close = closers.find(run, i + n, (at) => text[at - 1] !== "`" && text[at + n] !== "`");
      if (close === -1) {
        plain += run;
        i += n;
        continue;
      }
      let code = text.slice(i + n, close).replace(/\n/g, " ");
      if (code.length > 1 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
      flush();
      const element = doc.createElement("code");
      element.appendChild(doc.createTextNode(code));
      parent.appendChild(element);
      i = close + n;
      continue;
    }
    if ((c === "*" || c === "_") && depth < MAX_DEPTH) {
      const end = emphasisEnd(text, i, closers);
      if (end !== null) {
        flush();
        const element = doc.createElement(end.strong ? "strong" : "em");
        appendInline(element, text.slice(end.inner, end.close), doc, depth + 1, inLink);
        parent.appendChild(element);
        i = end.next;
        continue;
      }
    }
    if (c === "[" && !inLink && depth < MAX_DEPTH) {
      const link = linkEnd(text, i, closers);
      if (link !== null) {
        const href = safeHref(link.url);
        if (href !== null) {
          flush();
          const a = doc.createElement("a");
          a.setAttribute("href", href);
          a.setAttribute("rel", "noopener noreferrer nofollow");
          a.setAttribute("target", "_blank");
          appendInline(a, link.label, doc, depth + 1, true);
          parent.appendChild(a);
        } else {
          plain += text.slice(i, link.next); // an unsafe link stays the text it was
        }
        i = link.next;
        continue;
      }
    }
    plain += c;
    i += 1;
  }
  flush();
}

/** The emphasis opened at `i` (`*x*`, `_x_`, `**x**`, `__x__`), or null when it is not one. */
function emphasisEnd(text, i, closers) {
  const c = text[i];
  const strong = text[i + 1] === c;
  const marker = strong ? c + c : c;
  const inner = i + marker.length;
  if (isSpace(text[inner]) || text[inner] === c) return null;
  if (c === "_" && isWordChar(text[i - 1])) return null; // snake_case is not emphasis
  const close = closers.find(marker, inner + 1, (at) => {
    if (isSpace(text[at - 1]) || text[at - 1] === c || text[at + marker.length] === c) return false;
    return !(c === "_" && isWordChar(text[at + marker.length]));
  });
  return close === -1 ? null : { strong, inner, close, next: close + marker.length };
}

/** The link `[label](url)` opened at `i`, or null. */
function linkEnd(text, i, closers) {
  const middle = closers.find("](", i + 1, () => true);
  if (middle === -1) return null;
  const close = closers.find(")", middle + 2, () => true);
  if (close === -1) return null;
  const label = text.slice(i + 1, middle);
  const url = text.slice(middle + 2, close);
  if (!label || label.includes("[") || /\s/.test(url.trim())) return null;
  return { label, url, next: close + 1 };
}
