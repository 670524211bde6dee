// Runs the firmware tests on the MicroPython WebAssembly port, with the same runner as CPython
// and the unix port (tests/fw/run.py + tinytest.py).
//
//   node tools/mpy-wasm/run_wasm_tests.mjs [firmware-lib-dir] [test-dir] [test_module ...]
//
// Defaults: ../../firmware/lib and ../../tests/fw relative to this file. Copies the .py files into
// the port's in-memory file system (/lib is on its sys.path, tests go to /tests), awaits
// run.main() (the port has no asyncio.run), prints "N passed, M failed" via the runner and exits
// 1 on any failure or on a crash of the runner itself.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

import { loadMicroPython } from "@micropython/micropython-webassembly-pyscript";

const here = path.dirname(fileURLToPath(import.meta.url));
const [libDir = path.join(here, "../../firmware/lib"), testDir = path.join(here, "../../tests/fw"), ...modules] =
  process.argv.slice(2);

function copyPythonFiles(mp, sourceDir, targetDir) {
  mp.FS.mkdirTree(targetDir);
  for (const entry of fs.readdirSync(sourceDir, { withFileTypes: true })) {
    if (entry.isFile() && entry.name.endsWith(".py")) {
      mp.FS.writeFile(`${targetDir}/${entry.name}`, fs.readFileSync(path.join(sourceDir, entry.name)));
    }
  }
}

async function main() {
  for (const dir of [libDir, testDir]) {
    if (!fs.existsSync(dir)) throw new Error(`no such directory: ${dir}`);
  }
  // linebuffer (default) hands complete lines to stdout/stderr.
  const mp = await loadMicroPython({
    stdout: (line) => process.stdout.write(`${line}\n`),
    stderr: (line) => process.stderr.write(`${line}\n`),
  });
  copyPythonFiles(mp, libDir, "/lib");
  copyPythonFiles(mp, testDir, "/tests");
  mp.globals.set("_selected_modules", modules.length ? modules.join(",") : "");
  await mp.runPythonAsync(
    [
      "import sys",
      "sys.path.insert(0, '/tests')",
      "import run",
      "_selected = _selected_modules.split(',') if _selected_modules else None",
      "_failed = await run.main(_selected)",
    ].join("\n"),
  );
  return mp.globals.get("_failed");
}

try {
  const failed = await main();
  process.exitCode = failed === 0 ? 0 : 1;
} catch (error) {
  // PythonError carries the Python traceback in .message; anything else is a JS-side failure.
  console.error(error.name === "PythonError" ? error.message : error);
  console.log("0 passed, 1 failed");
  process.exitCode = 1;
}
