// The chat page's Markdown renderer against hostile model output, in node with a recording
// document: it may create only ALLOWED_TAGS, set only its own attributes (a link's href only
// when safe), and put model text only into text nodes. Run by tests/server/web/test_markdown.py
// as `node markdown_check.mjs PATH_TO_markdown.js`; exits non-zero on the first failure.

import assert from "node:assert/strict";
import { pathToFileURL } from "node:url";

const { ALLOWED_TAGS, renderMarkdown, safeHref } = await import(pathToFileURL(process.argv[2]).href);

const ATTRIBUTES = new Set(["href", "rel", "target", "class", "start"]);
const escapeText = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
const escapeAttr = (s) => escapeText(s).replace(/"/g, "&quot;");

/** A document that records what the renderer asks of it; anything else throws. */
function recordingDocument() {
  const created = [];
  class Text {
    constructor(text) {
      this.text = text;
      Object.freeze(this);
    }
    serialize() {
      return escapeText(this.text);
    }
  }
  class Element {
    constructor(tag) {
      this.tag = tag;
      this.children = [];
      this.attributes = new Map();
      Object.seal(this); // assigning innerHTML (or anything else) throws in a module
    }
    appendChild(child) {
      assert.ok(child instanceof Element || child instanceof Text, "appends only what it built");
      this.children.push(child);
      return child;
    }
    setAttribute(name, value) {
      assert.ok(ATTRIBUTES.has(name), `set attribute ${name}`);
      assert.equal(typeof value, "string");
      if (name === "href") assert.equal(safeHref(value), value, `unsafe href ${value}`);
      this.attributes.set(name, value);
    }
    serialize() {
      const inner = this.children.map((c) => c.serialize()).join("");
      if (this.tag === "#fragment") return inner;
      const attrs = [...this.attributes].map(([k, v]) => ` ${k}="${escapeAttr(v)}"`).join("");
      return this.tag === "br" || this.tag === "hr" ? `<${this.tag}${attrs}>` : `<${this.tag}${attrs}>${inner}</${this.tag}>`;
    }
  }
  const doc = Object.freeze({
    createDocumentFragment: () => new Element("#fragment"),
    createElement: (tag) => {
      assert.ok(ALLOWED_TAGS.includes(tag), `created <${tag}>`);
      created.push(tag);
      return new Element(tag);
    },
    createTextNode: (text) => new Text(String(text)),
  });
  return { doc, created };
}

function html(markdown) {
  const { doc } = recordingDocument();
  return renderMarkdown(markdown, doc).serialize();
}

const LINK = 'rel="noopener noreferrer nofollow" target="_blank"';
const cases = [
  // What it renders.
  ["**bold** and *it* and `code`", "<p><strong>bold</strong> and <em>it</em> and <code>code</code></p>"],
  ["__b__ _i_", "<p><strong>b</strong> <em>i</em></p>"],
  ["line one\nline two\n\nnext", "<p>line one<br>line two</p><p>next</p>"],
  ["```python\nprint('<b>')\n```\nafter", "<pre><code class=\"language-python\">print('&lt;b&gt;')</code></pre><p>after</p>"],
  ["```\nstill streaming", "<pre><code>still streaming</code></pre>"],
  ["- a\n- **b**\n  more", "<ul><li>a</li><li><strong>b</strong><br>more</li></ul>"],
  ["3. three\n4. four", "<ol start=\"3\"><li>three</li><li>four</li></ol>"],
  ["# Title #\n## C#", "<h3>Title</h3><h4>C#</h4>"],
  ["a\n\n---\n\nb", "<p>a</p><hr><p>b</p>"],
  ["[ft](https://example.com/a?b=1&c=2)", `<p><a href="https://example.com/a?b=1&amp;c=2" ${LINK}>ft</a></p>`],
  ["[**x** `y`](mailto:a@b.c)", `<p><a href="mailto:a@b.c" ${LINK}><strong>x</strong> <code>y</code></a></p>`],
  ["snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"],
  ["\\*not em\\* \\`not code\\`", "<p>*not em* `not code`</p>"],
  // Nested and unbalanced backticks.
  ["`` a `b` c ``", "<p><code>a `b` c</code></p>"],
  ["``` `` ```", "<pre><code></code></pre>"],
  ["x ```` ` ```` y", "<p>x <code>`</code> y</p>"],
  ["`unclosed and ``also", "<p>`unclosed and ``also</p>"],
  ["`a``b`", "<p><code>a``b</code></p>"],
  // Markup in the text stays text.
  ["<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"],
  ["<img src=x onerror=alert(1)>", "<p>&lt;img src=x onerror=alert(1)&gt;</p>"],
  ["`<script>x</script>`", "<p><code>&lt;script&gt;x&lt;/script&gt;</code></p>"],
  ["```\n</code></pre><script>alert(1)</script>\n```", "<pre><code>&lt;/code&gt;&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;</code></pre>"],
  ["**<b onmouseover=x>**", "<p><strong>&lt;b onmouseover=x&gt;</strong></p>"],
  ["```\" onmouseover=\"alert(1)\nx\n```", "<pre><code>x</code></pre>"],
  ["&lt;script&gt; &#106;", "<p>&amp;lt;script&amp;gt; &amp;#106;</p>"],
  // Links that may not be links stay the text they were.
  ["[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"],
  ["[x](JaVaScRiPt:alert(1))", "<p>[x](JaVaScRiPt:alert(1))</p>"],
  ["[x]( javascript:alert(1) )", "<p>[x]( javascript:alert(1) )</p>"],
  ["[x](java\tscript:alert(1))", "<p>[x](java\tscript:alert(1))</p>"],
  ["[x](&#106;avascript:alert(1))", "<p>[x](&amp;#106;avascript:alert(1))</p>"],
  ["[x](data:text/html,<script>alert(1)</script>)", "<p>[x](data:text/html,&lt;script&gt;alert(1)&lt;/script&gt;)</p>"],
  ["[x](vbscript:msgbox)", "<p>[x](vbscript:msgbox)</p>"],
  ["[x](//evil.example)", "<p>[x](//evil.example)</p>"],
  ["[x](/v1/admin/prepare-stop)", "<p>[x](/v1/admin/prepare-stop)</p>"],
  ["[x](https://a.example/\"onmouseover=\"alert(1))", `<p><a href="https://a.example/&quot;onmouseover=&quot;alert(1" ${LINK}>x</a>)</p>`],
  ["[[x](https://a.b)](https://c.d)", `<p>[<a href="https://a.b" ${LINK}>x</a>](https://c.d)</p>`],
];
for (const [markdown, expected] of cases) {
  assert.equal(html(markdown), expected, JSON.stringify(markdown));
}

for (const url of ["javascript:alert(1)", " JAVASCRIPT:x", "data:,x", "https://a b", "https://a\u0000b", "http:", "file:///etc/passwd"]) {
  assert.equal(safeHref(url), null, url);
}
assert.equal(safeHref(" https://ok.example/x "), "https://ok.example/x");

// Seeded random text over the characters that matter: every run builds only allowed tags and
// safe links (the recording document asserts both), and loses no character of plain text.
let seed = 12345;
const random = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
const ALPHABET = ["*", "_", "`", "[", "]", "(", ")", "\\", "\n", " ", "#", "-", "1.", "<", ">", "\"", "'", "&",
  "a", "b", "javascript:", "https://x.y", "<script>", "<img onerror=1>", "```", "~~~", "\t", "\r\n"];
for (let n = 0; n < 3000; n += 1) {
  const length = 1 + Math.floor(random() * 40);
  let text = "";
  for (let k = 0; k < length; k += 1) text += ALPHABET[Math.floor(random() * ALPHABET.length)];
  const { doc } = recordingDocument();
  renderMarkdown(text, doc);
}

// Inputs that would cost quadratic time without the remembered closers (a test's timeout
// catches them): 300,000 characters each.
const HUGE = 300_000;
for (const unit of ["*a", "**a", "_a", "`a", "``a", "[a", "[a](", "](", "a)", "` `` ```", "# ", "- ", "\n\n"]) {
  const { doc } = recordingDocument();
  renderMarkdown(unit.repeat(Math.ceil(HUGE / unit.length)), doc);
}
{
  const { doc } = recordingDocument();
  renderMarkdown("*".repeat(HUGE), doc);
  renderMarkdown("`".repeat(HUGE), doc);
  renderMarkdown("#".repeat(6) + " ".repeat(HUGE) + "x", doc);
  renderMarkdown("[".repeat(HUGE / 2) + "](".repeat(HUGE / 4), doc);
}

console.log(`markdown: ${cases.length} cases, 3000 random texts and 17 large inputs passed`);
