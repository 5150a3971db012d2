"""Helper programs written into a request's sandbox (under languages.HELPERS) beside its code.

They ship with DSec, not in the toolchain layers, so the layers stay plain Debian packages
and a fix here needs no rebuild. Each runs with the toolchain's own interpreter.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

TSRUN_JS = r"""'use strict';
// dsec: run a TypeScript file as tsx does for SandboxFusion: types are stripped, not checked
// (typescript's transpileModule), and the result runs as CommonJS. Syntax errors exit 1 with
// tsc-style messages; relative imports of other .ts files work; stack traces point at the
// .ts lines (inline source maps; node runs with --enable-source-maps).
const fs = require('fs');
const path = require('path');
let ts;
try {
  ts = require('typescript');
} catch (e) {
  process.stderr.write('dsec: the typescript module is missing: build the typescript toolchain\n');
  process.exit(127);
}
const compilerOptions = {
  module: ts.ModuleKind.CommonJS,
  target: ts.ScriptTarget.ES2020,
  esModuleInterop: true,
  inlineSourceMap: true,
  inlineSources: true,
};
function transpile(file) {
  const out = ts.transpileModule(fs.readFileSync(file, 'utf8'), {compilerOptions, fileName: file, reportDiagnostics: true});
  const errors = (out.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length) {
    for (const d of errors) {
      const where = d.file && d.start !== undefined ? d.file.getLineAndCharacterOfPosition(d.start) : {line: 0, character: 0};
      process.stderr.write(`${path.basename(file)}(${where.line + 1},${where.character + 1}): error TS${d.code}: ` +
                           `${ts.flattenDiagnosticMessageText(d.messageText, '\n')}\n`);
    }
    process.exit(1);
  }
  return out.outputText;
}
require.extensions['.ts'] = function (module, filename) {
  module._compile(transpile(filename), filename);
};
const main = path.resolve(process.argv[2]);
process.argv.splice(1, 1);
require(main);
"""


@cache
def helper(name: str) -> bytes:
    """The bytes of helper ``name`` (``tsrun.js``, ``jupyter_driver.py``)."""
    if name == "tsrun.js":
        return TSRUN_JS.encode()
    if name == "jupyter_driver.py":
        return Path(__file__).with_name("jupyter_driver.py").read_bytes()
    raise KeyError(name)
