/**
 * autogpu's sidebar: every GPU on the server, live, who holds it, and which one the active
 * notebook should pick. The data comes from the server extension (`{base_url}/autogpu/api/v1/`).
 *
 * It runs in JupyterLab (the left sidebar, with the other panels) and in Notebook 7, whose shell
 * has a left area too but no `ILabShell`: there the panel is added through `app.shell` and shown
 * from View → Left Sidebar → Show GPUs (autogpu).
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvg from '../style/icons/gpu.svg';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import {
  GPUPanel,
  IActiveNotebook,
  IExecuteResult,
  IPanelSettings
} from './panel';

/** The sidebar's icon. */
export const gpuIcon = new LabIcon({ name: 'autogpu:gpu', svgstr: gpuSvg });

const PLUGIN_ID = 'autogpu-jupyter:plugin';

// eslint-disable-next-line no-control-regex
const ANSI = /\x1b\[[0-9;]*m/g;

/** Run `code` in `kernel` (not stored in its history); what it printed, and whether it failed. */
async function executeIn(
  kernel: Kernel.IKernelConnection,
  code: string
): Promise<IExecuteResult> {
  const parts: string[] = [];
  const future = kernel.requestExecute({ code, store_history: false });
  future.onIOPub = (msg: KernelMessage.IIOPubMessage) => {
    if (KernelMessage.isStreamMsg(msg)) {
      parts.push(msg.content.text);
    } else if (KernelMessage.isErrorMsg(msg)) {
      parts.push(msg.content.traceback.join('\n').replace(ANSI, ''));
    }
  };
  const reply = await future.done;
  return { ok: reply.content.status === 'ok', text: parts.join('') };
}

function readSettings(settings: ISettingRegistry.ISettings): IPanelSettings {
  const get = <T>(key: string, fallback: T): T => {
    const value = settings.get(key).composite;
    return value === undefined || value === null ? fallback : (value as T);
  };
  return {
    refreshInterval: get<number>('refreshInterval', 2),
    recommendMinFree: get<string>('recommendMinFree', '10G'),
    historyPoints: get<number>('historyPoints', 120)
  };
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'A left-sidebar panel with every GPU on the server, its holders and a recommendation.',
  autoStart: true,
  optional: [ILabShell, ISettingRegistry, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    settingRegistry: ISettingRegistry | null,
    tracker: INotebookTracker | null
  ) => {
    const activeNotebook = (): IActiveNotebook | null => {
      const current = tracker?.currentWidget ?? null;
      if (current === null) {
        return null;
      }
      const kernel = current.sessionContext.session?.kernel ?? null;
      return {
        path: current.context.path,
        kernelId: kernel?.id ?? null,
        execute: kernel === null ? undefined : code => executeIn(kernel, code)
      };
    };
    const panel = new GPUPanel({
      serverSettings: app.serviceManager.serverSettings,
      activeNotebook
    });
    panel.title.icon = gpuIcon;
    panel.title.caption = 'GPUs (autogpu)';
    // JupyterLab's shell, or any shell with a left area (Notebook 7's INotebookShell).
    (labShell ?? app.shell).add(panel, 'left', { rank: 850 });
    tracker?.currentChanged.connect(() => {
      if (panel.isVisible) {
        void panel.poll.refresh();
      }
    });
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          panel.updateSettings(readSettings(settings));
          settings.changed.connect(() =>
            panel.updateSettings(readSettings(settings))
          );
        })
        .catch(reason => {
          console.error('autogpu: could not load the sidebar settings', reason);
        });
    }
  }
};

export default plugin;
