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


CSRUN_SH = r"""# dsec: C# as SandboxFusion runs it with `dotnet run` (build, then run, in one stage), with
# Mono: every .cs file of the working directory is compiled (as a .NET project's are), then run.
out=$(mktemp -d) || exit 1
mcs -nologo -r:System.Numerics.dll -r:System.Core.dll -out:"$out/Program.exe" ./*.cs || exit $?
exec mono "$out/Program.exe" "$@"
"""

JEST_CONFIG_JS = r"""'use strict';
// dsec: jest as SandboxFusion runs it (`npm run test` over its package.json and babel.config.js):
// tests in the working directory, TypeScript and modern JS through babel's env and typescript
// presets (resolved here, from Debian's node modules), two workers at most.
const babel = {
  presets: [[require.resolve('@babel/preset-env'), {targets: {node: 'current'}}],
            require.resolve('@babel/preset-typescript')],
};
module.exports = {
  rootDir: process.cwd(),
  maxWorkers: 2,
  cacheDirectory: '/tmp/jest-cache',
  transform: {'\\.[jt]sx?$': [require.resolve('babel-jest'), babel]},
};
"""


@cache
def helper(name: str) -> bytes:
    """The bytes of helper ``name`` (``tsrun.js``, ``jupyter_driver.py``, ``csrun.sh``, ``jest.config.js``)."""
    if name == "tsrun.js":
        return TSRUN_JS.encode()
    if name == "csrun.sh":
        return CSRUN_SH.encode()
    if name == "jest.config.js":
        return JEST_CONFIG_JS.encode()
    if name == "jupyter_driver.py":
        return Path(__file__).with_name("jupyter_driver.py").read_bytes()
    raise KeyError(name)
