// @ts-check
// `make mutate-ts` (issue 22): mutation testing of the sidebar's models -- the parsing of the
// server's answers, the views and the texts built from them -- by the jest tests. The widgets
// (panel.ts, cluster.ts), the plugin (index.ts) and the fetch wrapper (request.ts) are UI glue,
// checked in a real browser by tests/browser, too slow to run once per mutant.
/** @type {import('@stryker-mutator/api/core').PartialStrykerOptions} */
export default {
  packageManager: 'yarn',
  testRunner: 'jest',
  jest: { projectType: 'custom', configFile: 'jest.config.js' },
  mutate: ['src/model.ts', 'src/clustermodel.ts'],
  coverageAnalysis: 'perTest',
  // make mutate-ts STRYKER_JOBS=n; two by default (a small shared machine)
  concurrency: Number(process.env.STRYKER_JOBS || 2),
  reporters: ['clear-text', 'progress', 'html', 'json'],
  htmlReporter: { fileName: 'reports/mutation/mutation.html' },
  jsonReporter: { fileName: 'reports/mutation/mutation.json' },
  tempDirName: '.stryker-tmp',
  thresholds: { high: 95, low: 90, break: null }
};
